"""``evflow device CLASS [options]``: run one device standalone (FairMQ style)."""

from __future__ import annotations

import argparse

USAGE = """\
evflow device CLASS --id ID --channel-config CFG [--channel-config CFG ...]
              [--rate R] [--max-iterations N] [--session S]
              [--control static|interactive] [--severity LEVEL] [--stats-file F]
              [--PARAM VALUE ...]

CLASS is a built-in device (sampler, sink, splitter, merger, proxy) or module:Class.
CFG is name=data,type=push,method=bind,address=tcp://*:5555 (FairMQ keys) or a
.toml/.json file. `evflow device CLASS --help` lists the options of CLASS."""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "device",
        help="run one device standalone",
        usage=USAGE,
        description="Run one device with its state machine until it ends or is signalled.",
    )
    parser.add_argument("device_class", metavar="CLASS")
    parser.add_argument("device_args", nargs=argparse.REMAINDER, metavar="...")
    parser.set_defaults(func=_handle)


def _handle(args: argparse.Namespace) -> int:
    from evflow.runtime.runner import run_device_cli

    return run_device_cli(args.device_class, args.device_args)
