"""sampler -> sink throughput against a raw pyzmq PUSH/PULL loop, side by side.

    python benchmarks/bench_transport.py [--seconds 2] [--transports ipc,tcp] [--sizes ...]

Each cell runs, ``--repeat`` times interleaved, and reports the best of each: raw
pyzmq (sender sends N frames, receiver times first to last) and ``evflow device
sampler`` -> ``evflow device sink`` (wire-protocol messages, END with count and ACK;
the sink times first message to END). N is chosen so
that a cell takes about ``--seconds``. Both use the same high-water marks: 1000
messages, fewer for large messages so that at most ~200 MB are queued per socket.
Large payloads (>= 64 kB) are sent zero-copy by both, as one pre-built ``zmq.Frame``
that libzmq shares by reference count.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

SIZES = [64, 1024, 100 * 1024, 1024**2, 10 * 1024**2]
#: rough throughput guesses (msg/s) used only to pick N for ~--seconds per cell
GUESS_MSG_S = {64: 100_000, 1024: 90_000, 100 * 1024: 20_000, 1024**2: 3_000, 10 * 1024**2: 250}

RAW_RECV = r"""
import sys, time, zmq
addr, n, size, hwm = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
ctx = zmq.Context(); s = ctx.socket(zmq.PULL); s.setsockopt(zmq.RCVHWM, hwm); s.bind(addr)
print("bound", flush=True)
copy = size < 65536
s.recv(copy=copy); t0 = time.monotonic()
for _ in range(n - 1):
    s.recv(copy=copy)
dt = time.monotonic() - t0
print(dt, flush=True)
s.close(0); ctx.term()
"""
RAW_SEND = r"""
import os, sys, zmq
addr, n, size, hwm = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
ctx = zmq.Context(); s = ctx.socket(zmq.PUSH); s.setsockopt(zmq.SNDHWM, hwm); s.connect(addr)
payload = os.urandom(size); copy = size < 65536
if not copy:
    payload = zmq.Frame(payload)  # shared by reference count: no copy, no gc bookkeeping
for _ in range(n):
    s.send(payload, copy=copy)
sys.stdin.readline()  # the receiver is done: closing now cannot lose anything
s.close(0); ctx.term()
"""


def hwm_for(size: int) -> int:
    return max(10, min(1000, 200 * 1024**2 // max(size, 1)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def address(transport: str, tmp: Path, tag: str) -> str:
    if transport == "ipc":
        return f"ipc://{tmp}/{tag}.ipc"
    return f"tcp://127.0.0.1:{free_port()}"


def run_raw(transport: str, tmp: Path, n: int, size: int) -> float:
    addr = address(transport, tmp, "raw")
    hwm = str(hwm_for(size))
    recv = subprocess.Popen(
        [sys.executable, "-c", RAW_RECV, addr, str(n), str(size), hwm],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert recv.stdout is not None
    recv.stdout.readline()
    send = subprocess.Popen(
        [sys.executable, "-c", RAW_SEND, addr, str(n), str(size), hwm],
        stdin=subprocess.PIPE,
        text=True,
    )
    try:
        elapsed = float(recv.stdout.readline())
    finally:
        assert send.stdin is not None
        send.stdin.write("done\n")
        send.stdin.flush()
        send.wait(60)
        recv.wait(60)
    return n / elapsed


def run_evflow(transport: str, tmp: Path, n: int, size: int) -> float:
    data = address(transport, tmp, "data")
    ack = address(transport, tmp, "ack")
    hwm = hwm_for(size)
    stats = tmp / "sink.json"
    evflow = [sys.executable, "-m", "evflow", "device"]
    common = ["--severity", "warn", "--session", "bench"]
    cfg = f"sndBufSize={hwm},rcvBufSize={hwm},rateLogging=0"
    sink = subprocess.Popen(
        [
            *evflow,
            "sink",
            "--id",
            "sink",
            *common,
            "--stats-file",
            str(stats),
            "--channel-config",
            f"name=data,type=pull,method=bind,address={data},{cfg}",
            "--channel-config",
            f"name=data-ack,type=push,method=bind,address={ack}",
        ]
    )
    sampler = subprocess.Popen(
        [
            *evflow,
            "sampler",
            "--id",
            "sampler",
            *common,
            "--max-iterations",
            str(n),
            "--msg-size",
            str(size),
            "--channel-config",
            f"name=data,type=push,method=connect,address={data},{cfg}",
            "--channel-config",
            f"name=data-ack,type=pull,method=connect,address={ack}",
        ]
    )
    if sampler.wait(300) or sink.wait(300):
        raise RuntimeError(f"evflow devices failed ({sampler.returncode}, {sink.returncode})")
    result = json.loads(stats.read_text())["sink"]
    if result["received"] != n:
        raise RuntimeError(f"sink received {result['received']} of {n}")
    return float(result["msg_per_s"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0, help="target time per run (s)")
    parser.add_argument("--transports", default="ipc,tcp")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="bytes, comma-separated")
    parser.add_argument("--repeat", type=int, default=1, help="best of R runs of each")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="evb-"))
    os.environ["EVFLOW_RUNTIME_DIR"] = str(tmp)
    rows = []
    print(
        f"{'transport':9} {'size':>9} {'N':>8} {'raw msg/s':>11} {'raw GB/s':>9} "
        f"{'evflow msg/s':>13} {'evflow GB/s':>11} {'ratio':>6}"
    )
    try:
        for transport in args.transports.split(","):
            for size in map(int, args.sizes.split(",")):
                n = max(50, int(GUESS_MSG_S.get(size, 1000) * args.seconds))
                raws, ourss = [], []
                for _ in range(args.repeat):  # interleaved: both see the same machine load
                    raws.append(run_raw(transport, tmp, n, size))
                    ourss.append(run_evflow(transport, tmp, n, size))
                raw, ours = max(raws), max(ourss)
                row = (
                    transport,
                    size,
                    n,
                    raw,
                    raw * size / 1e9,
                    ours,
                    ours * size / 1e9,
                    ours / raw,
                )
                rows.append(row)
                print(
                    f"{row[0]:9} {_size(size):>9} {n:>8} {raw:>11,.0f} {row[4]:>9.3f} "
                    f"{ours:>13,.0f} {row[6]:>11.3f} {row[7]:>6.2f}",
                    flush=True,
                )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


def _size(n: int) -> str:
    for unit, scale in (("MB", 1024**2), ("kB", 1024)):
        if n >= scale:
            return f"{n // scale} {unit}"
    return f"{n} B"


if __name__ == "__main__":
    sys.exit(main())
