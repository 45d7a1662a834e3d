"""What every role of a parallel run shares: its channels and error reporting.

A run's sockets are ipc files in the session directory, one name per channel:

- ``events``  input ROUTER (bind)  <- worker DEALERs: HELLO, READY, GOODBYE / EVENTS, END
- ``results`` output PULL (bind)   <- worker PUSHes: EVENTS (results), RESULT
- ``back``    input ROUTER (bind)  <- output DEALER: HELLO, CONFIRM, GOODBYE / END
- ``ctl``     parent ROUTER (bind) <- every role's DEALER: HELLO, STATE, RESULT / STOP,
  KILL, WORKER_LOST
"""

from __future__ import annotations

from typing import Any

import zmq

from evflow.errors import ModuleError
from evflow.processing.datastore import RunMeta
from evflow.processing.parallel.split import SplitPath
from evflow.transport.channel import Channel, ChannelConfig, open_channel
from evflow.wire.messages import MsgType, encode_message


def channel(ctx: zmq.Context[Any], session: str, name: str, kind: str, method: str) -> Channel:
    """Open the run's channel ``name`` (an ipc file in the session directory).

    High-water marks are unlimited: credits bound what is in flight, and a ROUTER
    at its high-water mark would drop messages silently.
    """
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
    return open_channel(ctx, config, session)


def run_of(header_value: Any) -> RunMeta | None:
    """A ``[experiment, run]`` pair from a header (None stays None)."""
    return RunMeta(int(header_value[0]), int(header_value[1])) if header_value else None


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


def current_split() -> SplitPath:
    from evflow.processing.parallel import state

    return state.current()
