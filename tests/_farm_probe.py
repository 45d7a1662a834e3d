"""A stand-in for the agent in launcher tests: reports where it runs, then waits.

``python -m _farm_probe [--children N] [--exit CODE]`` prints one JSON line (pid, network
namespace inode, IPv4 addresses, environment marker) and waits for a signal. With
``--children N`` it first starts N descendants that try to escape a clean-up: each
starts its own session, ignores SIGTERM, and double-forks (the middle process exits, so
the grandchild is orphaned); the report waits until all of them are in place.
``--exit CODE`` ends at once with CODE after reporting.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import psutil


def _escaper(ready_fd: int) -> None:
    os.setsid()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if os.fork() == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        os.write(ready_fd, b"x")  # the orphan exists: the report may go out
        os.close(ready_fd)
        while True:
            time.sleep(1)
    os._exit(0)


def main(argv: list[str]) -> int:
    children = int(argv[argv.index("--children") + 1]) if "--children" in argv else 0
    exit_code = int(argv[argv.index("--exit") + 1]) if "--exit" in argv else None
    ready_r, ready_w = os.pipe()
    for _ in range(children):
        if os.fork() == 0:
            os.close(ready_r)
            _escaper(ready_w)
    os.close(ready_w)
    got = 0
    while got < children:  # every orphan is in place before we report
        got += len(os.read(ready_r, children - got) or b"?" * children)
    os.close(ready_r)
    addresses = sorted(
        a.address for addrs in psutil.net_if_addrs().values() for a in addrs if a.family == 2
    )
    report = {
        "pid": os.getpid(),
        "netns": os.stat("/proc/self/ns/net").st_ino,
        "addresses": addresses,
        "marker": os.environ.get("PROBE_MARKER", ""),
    }
    print(json.dumps(report), flush=True)
    if exit_code is not None:
        return exit_code
    while True:
        time.sleep(1)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
