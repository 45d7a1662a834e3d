"""What every role of a parallel run shares: its channels and error reporting.

A run's sockets are ipc files in the session directory, one name per channel:

- ``events``  input ROUTER (bind)  <- worker DEALERs: HELLO, READY, GOODBYE / EVENTS, END
- ``results`` output PULL (bind)   <- worker PUSHes: EVENTS (results), RESULT
- ``back``    input ROUTER (bind)  <- output DEALER: HELLO, CONFIRM, GOODBYE / END
- ``ctl``     parent ROUTER (bind) <- every role's DEALER: HELLO, STATE, RESULT / STOP,
  KILL, WORKER_LOST

and every role is also a node on the run's control bus (``rolebus.py``).
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from typing import Any, cast

import zmq

from evflow.errors import EvflowError, ModuleError
from evflow.event import RunMeta
from evflow.processing.parallel import tcpwire
from evflow.processing.parallel.rolebus import RoleBus
from evflow.processing.parallel.split import SplitPath
from evflow.runtime.states import State
from evflow.transport import security
from evflow.transport.channel import Channel, ChannelConfig
from evflow.transport.opening import open_channel
from evflow.wire.messages import MsgType, encode_message

__all__ = ["EXIT_ERROR", "RoleBus", "channel", "current_split", "run_role"]


def channel(
    ctx: zmq.Context[Any], session: str, name: str, kind: str, method: str, user: str = ""
) -> Channel:
    """Open the run's channel ``name`` (an ipc file in the session directory).

    High-water marks are unlimited: credits bound what is in flight, and a ROUTER
    at its high-water mark would drop messages silently. With the run's credentials
    installed (``security.current()``), a bound channel is a PLAIN server in ZAP
    domain ``name`` and a connecting one presents the secret as ``user``.
    """
    auth = security.current()
    configure = None
    if auth is not None:
        if method == "bind":
            configure = functools.partial(auth.server, domain=name)
        else:
            configure = functools.partial(auth.client, user=user)
    config = ChannelConfig(
        name=name,
        type=kind,
        method=method,
        address=f"ipc://{name}",
        sndBufSize=0,
        rcvBufSize=0,
        linger=0,
        rateLogging=0,
    )
    # hosts runs: tcp as well (tcpwire.py)
    ch = open_channel(ctx, tcpwire.adjust(config, session), session, configure=configure)
    if method == "bind":
        tcpwire.publish(session, name, ch.endpoints)
    return ch


#: who may connect to each socket a role binds (ZAP, transport/security.py)
ROLE_PEERS: dict[str, Callable[[str], bool]] = {
    "events": security.workers_only,
    "results": security.workers_only,
    "back": security.output_only,
}


def run_of(header_value: Any) -> RunMeta | None:
    """A ``[experiment, run]`` pair from a header (None, or anything else, gives None)."""
    if type(header_value) is not list or len(header_value) != 2:
        return None
    experiment, run = header_value
    if type(experiment) is not int or type(run) is not int:
        return None
    return RunMeta(experiment, run)


def error_message(role: str, exc: BaseException) -> list[Any]:
    """A STATE ERROR message for the parent: enough to rebuild one clear error there."""
    header: dict[str, Any] = {
        "state": "ERROR",
        "name": role,
        "error": str(exc),
        "kind": type(exc).__name__,
    }
    if isinstance(exc, ModuleError):
        header.update(
            module=exc.module,
            hook=exc.hook,
            uid=exc.uid,
            cause=type(exc.cause).__name__,
            cause_text=str(exc.cause),
            traceback=exc.traceback_text,
        )
    return encode_message(MsgType.STATE, header)


#: exit code of a role that reported an error to the parent
EXIT_ERROR = 3
#: the roles' garbage-collector thresholds: the input and output make and drop many
#: small containers per event (frame lists, ledger batches); a first generation of
#: 50 000 instead of 700 objects cut the input's CPU per 1 kB event by ~1 us
#: (BENCHMARKS.md, "Reliability"); cycles are still collected
GC_THRESHOLDS = (50_000, 20, 100)


def run_role(
    role: str,
    session: str,
    body: Callable[[zmq.Context[Any], list[Channel], RoleBus], int],
    on_error: Callable[[], None] | None = None,
    auth: security.RunAuth | None = None,
) -> int:
    """Run a forked role's ``body`` in its own zmq context; return its exit code.

    ``body`` opens its channels into the list it is given, the ctl channel first, and
    gets the role's node on the run's control bus (rolebus.py; closed here, EXITING,
    or ERROR on a failure). An EvflowError becomes one STATE ERROR message to the
    parent on ctl (after ``on_error``, e.g. closing writers) and exit code EXIT_ERROR;
    every channel and the context are closed whatever happens. ``auth`` (the run's
    credentials) secures every channel; the input and output, which bind, check their
    peers with a ZAP handler (only processes of the run, holding the secret).
    """
    gc.freeze()  # what the zygote imported is never garbage: keep it out of every scan
    gc.set_threshold(*GC_THRESHOLDS)
    security.install(auth)
    ctx = zmq.Context()
    channels: list[Channel] = []
    zap = None
    if auth is not None and role in ("input", "output"):
        zap = auth.handler(ctx, role, ROLE_PEERS)  # before any socket binds
    bus = RoleBus(ctx, session, role)
    try:
        return body(ctx, channels, bus)
    except EvflowError as exc:
        bus.set_state(State.ERROR)
        if on_error is not None:
            on_error()
        if not channels:
            raise  # no ctl to report on: the zygote reports the exit and traceback
        ctl = channels[0].socket
        ctl.send_multipart(error_message(role, exc))
        ctl.linger = 2000  # the parent must hear why
        return EXIT_ERROR
    except Exception:
        bus.set_state(State.ERROR)
        raise
    finally:
        bus.close()
        for ch in channels:
            ch.close(linger_ms=cast(int, ch.socket.linger))
        if zap is not None:
            zap.close()
        ctx.term()


def current_split() -> SplitPath:
    from evflow.processing.parallel import currentsplit

    return currentsplit.current()
