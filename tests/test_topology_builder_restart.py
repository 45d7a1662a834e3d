"""A SIGKILLed event builder that ``evflow up`` restarts gets its streams back (issue 21):
the trigger chain of the chaos runs (replay as 3 fragment streams at 1500 Hz -> event
builder -> sink, every device ``restart = "on-failure"``), the builder killed once the
sink has about a fifth of the stream, must end by itself with exit 0 and exact counts:
the sink received what the builder announced, the builder (both processes) sent on
every one of the 6000 events once and complete, and nothing is left behind.

Before, the replay's fragment senders had said HELLO to the dead builder only: the new
one granted them no credit, the replay waited for credit for ever and the topology
never ended (``EXCLUDED`` in tests/_topo_chaos.py). Now the senders say HELLO again,
see a new builder in its answer and send again what the dead one had not built; the
new process goes on from the dead one's record and refuses what it had built.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from _topo_chaos import END_BOUND_S, TRIGGER_EVENTS, Plan, _Run, _write_topology

#: the sink's batches of built events: about 32 events each (1500 Hz, 21 ms ticks)
KILL_AT_BATCHES = 40


def sink_batches(runtime: Path) -> int:
    """What the sink has received so far (its stream record, one counter per message)."""
    for path in runtime.glob("*/sink.counts"):
        data = path.read_bytes()
        if len(data) >= 8:
            return int(np.frombuffer(data[:8], np.int64)[0])
    return 0


@pytest.mark.timeout(300)  # END_BOUND_S, then the harness's own bounds for a hung run
def test_a_builder_sigkilled_mid_stream_is_restarted_and_the_run_ends_exactly(
    tmp_path: Path,
) -> None:
    runtime = tmp_path / "rt"
    runtime.mkdir(mode=0o700)
    run = _Run(Plan("trigger", 0, []), tmp_path, runtime)
    try:
        run.start(_write_topology("trigger", tmp_path))
        assert run.lines is not None and run.proc is not None
        run.lines.wait_for("devices RUNNING", 60)
        builder = run.pid_of("eventbuilder")
        assert builder is not None, "no event builder process"
        deadline = time.monotonic() + 60
        while (got := sink_batches(runtime)) < KILL_AT_BATCHES:
            assert time.monotonic() < deadline, f"the sink has {got} batches after 60 s"
            assert not run.wait_exit(0.01), "evflow up ended before the kill"
        builder.send_signal(signal.SIGKILL)
        run.killed.add("eventbuilder")
        run.out.kills += 1
        run.note(f"SIGKILL eventbuilder (pid {builder.pid}) after {got} batches at the sink")
        assert got < TRIGGER_EVENTS // 64, "the kill came after the middle of the stream"
        ended = run.wait_exit(END_BOUND_S)
        if not ended:
            run.finish_hung()
        assert ended, f"evflow up did not end within {END_BOUND_S:g} s:\n" + run.text()[-3000:]
        code = run.proc.wait(timeout=30)
        run.note(f"evflow up exited with {code}")
        run.judge_end(code, started=True, why="")
        found = {p.stem: json.loads(p.read_text()) for p in run.stats.glob("*.json")}
    finally:
        if run.proc is not None and run.proc.poll() is None:
            run.finish_hung()
        run.out.leftovers = run.leftovers()
    report = run.out.report()
    assert (code, run.out.result) == (0, "passed"), report
    assert not run.out.leftovers, report
    assert "restarting in" in run.text(), "the builder was not restarted: " + report
    eb = found["eventbuilder"]["eventbuilder"]
    replay = found["replay"]["replay"]
    sink = found["sink"]["sink"]
    assert eb["resumed"] is True, eb
    # every event sent on once (a lost one would make it fewer, one built twice more),
    # and complete: what the dead process had not built came again from the replay
    assert eb["events_sent_on"] == TRIGGER_EVENTS, eb
    assert eb["incomplete"] == 0, eb
    assert sink["received"] == sink["announced"] == eb["sent_on"], (sink, eb)
    assert replay["sent"] == TRIGGER_EVENTS and replay["builder_restarts"] == 1, replay
    assert replay["resent"] > 0, replay
