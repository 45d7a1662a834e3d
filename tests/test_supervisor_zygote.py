"""A supervisor whose zygote is SIGKILLed: replaced when asked (its children, killed
with it, restarted by their policy from the new zygote), otherwise as before."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import pytest

from evflow.errors import PeerLostError
from evflow.runtime.supervisor import ExitEvent, ProcessSpec, Supervisor


def _sleep(seconds: float) -> None:
    time.sleep(seconds)


def _events_until(
    sup: Supervisor, done: Callable[[list[ExitEvent]], object], timeout_s: float = 10.0
) -> list[ExitEvent]:
    events: list[ExitEvent] = []
    deadline = time.monotonic() + timeout_s
    while not done(events) and time.monotonic() < deadline:
        events += sup.poll(0.05)
    assert done(events), f"only {events} within {timeout_s} s"
    return events


def test_a_killed_zygote_is_replaced_and_its_children_restarted() -> None:
    sup = Supervisor()
    sup.replace_lost_zygote = True
    new_pids: list[int] = []
    sup.on_new_zygote.append(new_pids.append)
    sup.add(ProcessSpec("a", target=_sleep, args=(60,), restart="on-failure", backoff_s=0.0))
    sup.start()
    try:
        old_zygote, old_child = sup.zygote.pid, sup.processes["a"].pid
        assert old_zygote is not None and old_child is not None
        os.kill(old_zygote, signal.SIGKILL)
        events = _events_until(sup, lambda ev: sup.processes["a"].state == "running" and ev)
        assert [(e.name, e.pid, e.returncode) for e in events] == [("a", old_child, -9)]
        assert sup.zygote_replacements == 1 and new_pids == [sup.zygote.pid]
        assert sup.zygote.pid != old_zygote and sup.zygote.alive
        assert sup.processes["a"].pid in sup.zygote.children  # forked by the new zygote
    finally:
        sup.close()


def test_without_replacement_a_lost_zygote_still_refuses_to_spawn() -> None:
    sup = Supervisor()
    sup.add(ProcessSpec("a", target=_sleep, args=(60,), restart="never"))
    sup.start()
    try:
        assert sup.zygote.pid is not None
        os.kill(sup.zygote.pid, signal.SIGKILL)
        _events_until(sup, lambda ev: bool(ev))
        with pytest.raises(PeerLostError, match="cannot spawn 'b'"):
            sup.add(ProcessSpec("b", target=_sleep, args=(60,)))
        assert sup.zygote_replacements == 0
    finally:
        sup.close()
