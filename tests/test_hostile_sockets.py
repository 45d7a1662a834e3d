"""Issue 10, item 17: sockets of every plausible type send garbage to a running session.

For each of the run's four ipc endpoints (``events``, ``results``, ``back``, ``ctl``)
a socket of every type that could be pointed at it (push, dealer, router, pub, req,
pair, xpub, sub) sends a catalogue of malformed and forged messages (every message
type with empty, odd, out-of-range and hostile headers). The connection check is off
(``ipc_auth``): every message reaches a handler, which must drop it and count it. The
run finishes with exit code 0 and every uid exactly once in its output.
"""

from __future__ import annotations

from pathlib import Path

from _hostile import ALL_TYPES, ENDPOINTS, HostileRun, garbage_messages, send


def test_every_socket_type_on_every_endpoint_gets_nothing_acted_on(tmp_path: Path) -> None:
    with HostileRun(tmp_path, n=2500, extra={"ipc_auth": False}) as run:
        run.wait_flowing()
        sent = 0
        for name in ENDPOINTS:
            for kind in ALL_TYPES:
                # no wait for the connection: what a type queues on connect goes out
                # once it is up, what it cannot send yet is what an attacker loses
                sock = run.connect(kind, name)
                for frames in garbage_messages():
                    sent += send(sock, frames)
        assert sent > 1000, "the attack never got its messages out"
        rc, summary, err = run.finish()
        assert rc == 0, err
        run.assert_exactly_once()
        assert summary["counters"]["output restarts"] == summary["counters"]["input restarts"] == 0
        assert summary["counters"]["events lost"] == 0
        # the handlers saw them (the parent, input and output count what they drop)
        assert summary["counters"].get("malformed messages", 0) > 0
