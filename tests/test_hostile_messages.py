"""Items 9-13 of issue 10: forged and garbage messages sent to a running session.

Each test starts a real parallel run (tests/_hostile.py), connects real zmq sockets to
the ipc files in its session directory and sends what a hostile or broken process
would. The run must finish as if nothing happened: exit code 0 and every uid exactly
once in the output file. These runs have the connection check off (``ipc_auth``), so
that every message reaches the handlers: what is tested here is their validation,
the second line of defence; test_security.py tests the first (ZAP) and both together.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import zmq

from _hostile import HostileRun, msg, send
from evflow.processing.parallel.batching import pack_batch, u64
from evflow.wire.messages import MsgType, encode_message, hello_header

NO_AUTH = {"ipc_auth": False}


def _assert_undisturbed(summary: dict[str, Any]) -> None:
    """No role crashed on the way (a restart would hide a crash behind a complete file)."""
    counters = summary["counters"]
    assert counters["output restarts"] == counters["input restarts"] == 0, counters
    assert counters["events lost"] == 0


def _settle(run: HostileRun) -> None:
    run.wait_flowing()  # the run is under way: workers said HELLO, events flow


def test_garbage_event_bytes_on_the_results_socket_do_not_stop_the_run(tmp_path: Path) -> None:
    # item 9: a well-formed EVENTS header whose event frames are not events
    with HostileRun(tmp_path, n=1500, extra=NO_AUTH) as run:
        push = run.connect(zmq.PUSH, "results")
        _settle(run)
        for first in (1400, 1450):  # uids not processed yet: the real ones must still land
            uids = list(range(first, first + 5))
            header = {"b": 7, "a": 1, "u": u64(uids), "s": u64(uids), "k": b"\x01" * 5}
            header["w"] = "worker-0"
            payload = pack_batch([[b"garbage %d" % u] for u in uids], header, packed=True)
            send(push, encode_message(MsgType.EVENTS, header, payload))
        rc, summary, err = run.finish()
        assert rc == 0, err
        run.assert_exactly_once()
        _assert_undisturbed(summary)


def test_end_with_an_empty_header_does_not_crash_the_output(tmp_path: Path) -> None:
    # item 10: END {} on the results socket (a KeyError outside the handler's try)
    with HostileRun(tmp_path, n=1500, extra=NO_AUTH) as run:
        push = run.connect(zmq.PUSH, "results")
        _settle(run)
        send(push, msg(MsgType.END, {}))
        rc, summary, err = run.finish()
        assert rc == 0, err
        run.assert_exactly_once()
        _assert_undisturbed(summary)


def test_a_forged_end_does_not_make_the_output_finish_early(tmp_path: Path) -> None:
    # item 10: END {"workers": []}: the output finished, the run lost the rest
    with HostileRun(tmp_path, n=2000, extra=NO_AUTH) as run:
        push = run.connect(zmq.PUSH, "results")
        _settle(run)
        send(push, msg(MsgType.END, {"workers": [], "read": 0, "sent": 0}))
        rc, summary, err = run.finish()
        assert rc == 0, err
        run.assert_exactly_once()
        _assert_undisturbed(summary)
        assert summary["counters"]["events lost"] == 0


def test_hello_with_an_odd_map_on_the_back_socket_is_not_a_new_output(tmp_path: Path) -> None:
    # item 11: the input took the sender for a restarted output and re-sent to a ghost
    with HostileRun(tmp_path, n=2000, extra=NO_AUTH) as run:
        _settle(run)
        for header in ({}, {"x": 1}, hello_header(role="output", name="output", pid=1)):
            dealer = run.connect(zmq.DEALER, "back")
            send(dealer, msg(MsgType.HELLO, header))
        rc, summary, err = run.finish(timeout_s=45)
        assert rc == 0, err
        run.assert_exactly_once()
        _assert_undisturbed(summary)


def test_hello_with_an_infinite_pid_on_the_events_socket(tmp_path: Path) -> None:
    # item 12: int(inf) raised OverflowError, uncaught, in the input
    with HostileRun(tmp_path, n=1500, extra=NO_AUTH) as run:
        dealer = run.connect(zmq.DEALER, "events")
        _settle(run)
        for pid in (float("inf"), float("nan"), 2**64 - 1, -5, "12"):
            send(dealer, msg(MsgType.HELLO, hello_header(name="worker-9", pid=pid)))
        rc, summary, err = run.finish()
        assert rc == 0, err
        run.assert_exactly_once()
        _assert_undisturbed(summary)


def test_forged_confirms_do_not_make_the_ledger_forget_events(tmp_path: Path) -> None:
    # item 13: CONFIRMs of every uid, then a worker dies: its events must be re-sent
    n = 2000
    with HostileRun(tmp_path, n=n, work_ms=2.0, extra=NO_AUTH) as run:
        dealers = [run.connect(zmq.DEALER, "back") for _ in range(3)]
        _settle(run)
        confirm = encode_message(MsgType.CONFIRM, {"n": n}, [u64(range(n))])
        for _ in range(20):
            for d in dealers:
                send(d, confirm)
            time.sleep(0.02)
        workers = run.workers()
        assert workers, "no worker process found"
        workers[0].kill()  # its unconfirmed events must go to another worker
        rc, summary, err = run.finish()
        assert rc == 0, err
        run.assert_exactly_once()
        _assert_undisturbed(summary)
        assert summary["counters"]["events lost"] == 0


def test_a_forged_state_error_on_ctl_does_not_abort_the_run(tmp_path: Path) -> None:
    # item 13: STATE ERROR {name: input} from anyone aborted any run
    with HostileRun(tmp_path, n=1500, extra=NO_AUTH) as run:
        dealer = run.connect(zmq.DEALER, "ctl")
        _settle(run)
        for name in ("input", "output", "worker-0"):
            header = {"state": "ERROR", "name": name, "error": "forged", "kind": "PeerLostError"}
            send(dealer, msg(MsgType.STATE, header))
            send(dealer, msg(MsgType.HELLO, {"role": name, "name": name, "pid": 1}))
            send(dealer, msg(MsgType.STATE, header))
        timeout = {"state": "TIMEOUT", "name": "input", "worker": "worker-0"}
        send(dealer, msg(MsgType.STATE, timeout))
        rc, summary, err = run.finish()
        assert rc == 0, err
        assert "forged" not in err
        run.assert_exactly_once()
        _assert_undisturbed(summary)
        assert summary["counters"]["workers lost"] == 0
