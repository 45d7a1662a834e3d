"""Walking one device down FairMQ's shutdown sequence over the control bus.

The supervisor's orderly shutdown uses this for processes that are devices: each round
asks the device for its state and requests the shutdown step of that state (RUNNING:
STOP, READY: RESET_TASK, DEVICE_READY: RESET_DEVICE, IDLE: END). A device busy in a hook
answers late, so timeouts only end the walk at the deadline.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from evflow.errors import EvflowError, TimeoutError_
from evflow.runtime.states import SHUTDOWN_STEP, State

log = logging.getLogger("evflow.supervisor")


def walk_down(
    controller: Any,
    device_id: str,
    deadline_s: float,
    *,
    poll: Callable[[float], object],
    alive: Callable[[], bool],
    fast: Callable[[], bool],
) -> None:
    """Request shutdown steps of ``device_id`` until it takes END, exits or time is up.

    ``controller`` is a ``BusController``; ``poll(timeout_s)`` reaps exits (so that
    ``alive()`` turns False as soon as the device exits); ``fast()`` True ends the walk
    (a second signal). ``deadline_s`` is on the ``time.monotonic()`` clock.
    """
    requested: set[tuple[str, str]] = set()

    def gone() -> bool:  # notice its exit while we wait for an answer
        poll(0)
        return not alive() or fast()

    while not fast() and (left := deadline_s - time.monotonic()) > 0:
        poll(0)
        if not alive():
            return
        try:
            replies = controller.request(
                "check-state", device_id, timeout_s=min(1.2, left), abort=gone
            )
            if not replies:
                continue  # aborted: it exited (checked above) or a fast stop
            state = State((replies[0].get("data") or {}).get("node_state"))
        except TimeoutError_:
            continue
        except (EvflowError, ValueError) as exc:
            log.warning("device %s: no state over the bus (%s)", device_id, exc)
            return
        step = SHUTDOWN_STEP.get(state)
        if step is None or (state.name, step.name) in requested:
            poll(0.05)
            continue
        log.info("stopping device %s: %s -> %s", device_id, state, step)
        requested.add((state.name, step.name))
        try:
            controller.request(
                "transition",
                device_id,
                {"transition": step.name},
                timeout_s=max(0.1, min(1.2, deadline_s - time.monotonic())),
                abort=gone,
            )
        except TimeoutError_:
            continue
        if step.name == "END":
            return  # the device exits by itself now; the caller waits for it
