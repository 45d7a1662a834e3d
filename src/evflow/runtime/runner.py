"""Run one device standalone, FairMQ style: ``evflow device CLASS --id ... --channel-config ...``.

CLASS is a built-in name (``sampler``, ``sink``, ``splitter``, ``merger``, ``proxy``) or
``module:Class``. The class's declared ``Param`` attributes become options
(``msg_size`` -> ``--msg-size``). SIGINT/SIGTERM in any state start the orderly
shutdown (exit code 0 when it completes); a second one leaves at once (exit 130), still
closing sockets and removing ipc files.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from evflow.errors import ConfigurationError, ParameterError
from evflow.runtime.devices import BUILTIN_DEVICES

log = logging.getLogger("evflow.device")

SEVERITIES = {
    "trace": logging.DEBUG,
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warn": logging.WARNING,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "fatal": logging.CRITICAL,
    "nolog": logging.CRITICAL + 10,
}
#: FairMQ's interactive keys
KEYS = {
    "i": "INIT_DEVICE",
    "k": "COMPLETE_INIT",
    "b": "BIND",
    "x": "CONNECT",
    "j": "INIT_TASK",
    "r": "RUN",
    "s": "STOP",
    "t": "RESET_TASK",
    "d": "RESET_DEVICE",
    "q": "END",
}


class FastExit(BaseException):
    """Raised by the second SIGINT/SIGTERM: leave now (BaseException: hooks cannot eat it)."""


def load_device_class(spec: str) -> type[Any]:
    """A built-in name or ``module:Class`` -> the Device subclass; ConfigurationError if not."""
    from evflow.runtime.device import Device

    target = BUILTIN_DEVICES.get(spec, spec)
    if ":" not in target:
        raise ConfigurationError(
            f"device class {spec!r} not found: not a built-in device "
            f"({', '.join(sorted(BUILTIN_DEVICES))}) and not of the form module:Class"
        )
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise ConfigurationError(
            f"device class {spec!r} not found: no module {exc.name!r} (is it on PYTHONPATH?)"
        ) from None
    cls = getattr(module, attr, None)
    if cls is None:
        raise ConfigurationError(
            f"device class {spec!r} not found: module {module_name!r} has no {attr!r}"
        )
    if not (isinstance(cls, type) and issubclass(cls, Device)):
        raise ConfigurationError(f"{spec!r} is not a Device subclass (got {cls!r})")
    return cls


def _param_converter(type_: Any, name: str) -> Any:
    if type_ is bool:

        def to_bool(text: str) -> bool:
            low = text.lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise argparse.ArgumentTypeError(f"--{name} expects true or false, got {text!r}")

        return to_bool
    return type_ if type_ in (int, float, str) else str


def build_parser(cls: type[Any], class_spec: str) -> argparse.ArgumentParser:
    """Standard device options plus one ``--name`` per declared parameter of ``cls``."""
    parser = argparse.ArgumentParser(
        prog=f"evflow device {class_spec}",
        description=cls.description or cls.__doc__,
    )
    parser.add_argument("--id", default="", help="device id (default: the class name)")
    parser.add_argument(
        "--channel-config",
        action="append",
        default=[],
        metavar="CFG",
        help="name=..,type=..,method=..,address=.. or a .toml/.json file "
        "(repeatable; a repeated name makes sub-channels)",
    )
    parser.add_argument("--rate", type=float, default=0.0, help="conditional_run calls per s")
    parser.add_argument(
        "--max-iterations",
        type=int,
        default=0,
        help="stop RUNNING after N iterations/messages (0 = no limit)",
    )
    parser.add_argument("--session", default="default", help="session (ipc directory)")
    parser.add_argument("--control", choices=("static", "interactive"), default="static")
    parser.add_argument("--severity", choices=sorted(SEVERITIES), default="info")
    parser.add_argument(
        "--stats-file", type=Path, default=None, help="write the device summary (JSON) here at exit"
    )
    parser.add_argument(
        "--bus",
        default="",
        metavar="PUB,SUB",
        help="join the control bus at these endpoints: the proxy's XSUB and XPUB "
        "(',' or ';' between them)",
    )
    for name, spec in cls.declared_params().items():
        conv = _param_converter(spec.type, name)
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            dest=f"param_{name}",
            type=conv,
            default=None,
            metavar=spec.type_name.upper(),
            help=f"{spec.doc} (default {spec.default!r})",
        )
    return parser


def _stdin_control(device: Any) -> None:
    """Interactive control: transition names or FairMQ keys, one per line."""
    from evflow.errors import StateTransitionError
    from evflow.runtime.states import parse_transition

    for line in sys.stdin:
        word = line.strip()
        if not word:
            continue
        try:
            device.request(parse_transition(KEYS.get(word, word)))
        except StateTransitionError as exc:
            log.error("%s", exc)


def _attach_bus(device: Any, endpoints: str, context: Any) -> Any:
    try:
        from evflow.runtime import bus as bus_module
    except ImportError:
        raise ConfigurationError("--bus given but evflow.runtime.bus is not available") from None
    client = bus_module.BusClient(context, device.id, endpoints)
    device.attach_bus(client)
    return client


def run_device_cli(class_spec: str, argv: Sequence[str]) -> int:
    """Parse ``argv`` for ``class_spec``, run the device to EXITING, return the exit code."""
    state: dict[str, Any] = {"device": None, "signals": 0}

    def on_signal(signum: int, frame: FrameType | None) -> None:
        state["signals"] += 1
        if state["signals"] > 1:
            raise FastExit(signum)
        log.info("%s received: orderly shutdown", signal.Signals(signum).name)
        if state["device"] is not None:
            state["device"].request_shutdown()

    # installed first, so that a signal during start-up is not lost
    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _run(class_spec, argv, state)
    except FastExit:
        return 130
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def _setup_logging(argv: Sequence[str]) -> None:
    """Logging first (before the class is imported), from ``--severity`` if given."""
    level = "info"
    for i, arg in enumerate(argv):
        if arg == "--severity" and i + 1 < len(argv):
            level = argv[i + 1]
        elif arg.startswith("--severity="):
            level = arg.split("=", 1)[1]
    logging.basicConfig(
        level=SEVERITIES.get(level, logging.INFO),
        stream=sys.stderr,
        format="[%(asctime)s][%(levelname)s] %(message)s",
    )


def _run(class_spec: str, argv: Sequence[str], state: dict[str, Any]) -> int:
    import zmq

    from evflow.transport.channel import channel_configs_from_args

    _setup_logging(argv)
    cls = load_device_class(class_spec)
    args = build_parser(cls, class_spec).parse_args(list(argv))
    configs = channel_configs_from_args(args.channel_config)
    params = {
        k[len("param_") :]: v
        for k, v in vars(args).items()
        if k.startswith("param_") and v is not None
    }
    context = zmq.Context()
    device = None
    bus = None
    code: int = 1
    try:
        device = cls(
            args.id,
            configs,
            session=args.session,
            rate_hz=args.rate,
            max_iterations=args.max_iterations,
            context=context,
            **params,
        )
        device.fsm.subscribe(lambda old, new, tr: log.info("%s: %s", device.id, new))
        if args.bus:
            bus = _attach_bus(device, args.bus, context)
        state["device"] = device
        if state["signals"]:
            device.request_shutdown()
        if args.control == "interactive":
            threading.Thread(target=_stdin_control, args=(device,), daemon=True).start()
        code = device.run(args.control)
        if device.error is not None:
            print(
                f"evflow: error: device {device.id!r}: {type(device.error).__name__}: "
                f"{device.error}",
                file=sys.stderr,
            )
    except ParameterError:
        raise
    finally:
        if device is not None:
            if args.stats_file is not None:
                args.stats_file.write_text(json.dumps(device.summary(), default=str))
            device.close_channels(linger_ms=0)
        if bus is not None:
            bus.close()
        context.destroy(linger=0)
    return code
