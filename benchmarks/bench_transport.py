"""sampler -> sink throughput against a raw pyzmq PUSH/PULL loop, side by side.

    python benchmarks/bench_transport.py [--seconds 2] [--repeat 3] [--transports ipc,tcp]
                                         [--sizes 64,1024,...]

Each cell runs ``--repeat`` times, raw and evflow interleaved, and reports the best of
each: raw pyzmq (sender sends N single frames, receiver times first to last) and
``evflow device sampler`` -> ``evflow device sink`` (wire-protocol messages, END with
the count and an ACK; the sink times first message to END). N is chosen so that a run
takes about ``--seconds``. Both use the same high-water marks: 1000 messages, fewer
for large messages so that at most ~200 MB are queued per socket. Large payloads
(>= 64 kB) are sent zero-copy by both, as one pre-built ``zmq.Frame`` that libzmq
shares by reference count.

Besides msg/s, it reports CPU microseconds per message (sender + receiver, all threads,
best run): on a shared machine wall-clock rates swing with other load, CPU per message
much less.
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
#: rough rates (msg/s) used only to pick N for ~--seconds per run
GUESS_MSG_S = {64: 100_000, 1024: 90_000, 100 * 1024: 20_000, 1024**2: 3_000, 10 * 1024**2: 250}

RAW_RECV = r"""
import sys, time, zmq
addr, n, size, hwm = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
ctx = zmq.Context(); s = ctx.socket(zmq.PULL); s.setsockopt(zmq.RCVHWM, hwm); s.bind(addr)
print("bound", flush=True)
copy = size < 65536
s.recv(copy=copy); t0 = time.monotonic(); c0 = time.process_time()
for _ in range(n - 1):
    s.recv(copy=copy)
print(time.monotonic() - t0, time.process_time() - c0, flush=True)
s.close(0); ctx.term()
"""
RAW_SEND = r"""
import os, sys, time, zmq
addr, n, size, hwm = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
ctx = zmq.Context(); s = ctx.socket(zmq.PUSH); s.setsockopt(zmq.SNDHWM, hwm); s.connect(addr)
payload = os.urandom(size); copy = size < 65536
if not copy:
    payload = zmq.Frame(payload)  # shared by reference count: no copy, no gc bookkeeping
c0 = time.process_time()
for _ in range(n):
    s.send(payload, copy=copy)
print(time.process_time() - c0, flush=True)
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


def run_raw(transport: str, tmp: Path, n: int, size: int) -> tuple[float, float]:
    """(msg/s at the receiver, CPU s of sender + receiver)."""
    argv = [address(transport, tmp, "raw"), str(n), str(size), str(hwm_for(size))]
    recv = subprocess.Popen(
        [sys.executable, "-c", RAW_RECV, *argv], stdout=subprocess.PIPE, text=True
    )
    assert recv.stdout is not None
    recv.stdout.readline()
    send = subprocess.Popen(
        [sys.executable, "-c", RAW_SEND, *argv],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert send.stdin is not None and send.stdout is not None
    try:
        elapsed, recv_cpu = map(float, recv.stdout.readline().split())
        send_cpu = float(send.stdout.readline())
    finally:
        send.stdin.write("done\n")
        send.stdin.flush()
        send.wait(60)
        recv.wait(60)
    return n / elapsed, recv_cpu + send_cpu


def run_evflow(transport: str, tmp: Path, n: int, size: int) -> tuple[float, float]:
    """(msg/s at the sink, CPU s of sampler + sink while running)."""
    data = address(transport, tmp, "data")
    ack = address(transport, tmp, "ack")
    hwm = hwm_for(size)
    evflow = [sys.executable, "-m", "evflow", "device"]
    common = ["--severity", "warn", "--session", "bench"]
    cfg = f"sndBufSize={hwm},rcvBufSize={hwm},rateLogging=0"
    sink = subprocess.Popen(
        [*evflow, "sink", "--id", "sink", *common, "--stats-file", str(tmp / "sink.json"),
         "--read-payload", "false",  # as the raw loop: the bytes are not read
         "--channel-config", f"name=data,type=pull,method=bind,address={data},{cfg}",
         "--channel-config", f"name=data-ack,type=push,method=bind,address={ack}"]
    )  # fmt: skip
    sampler = subprocess.Popen(
        [*evflow, "sampler", "--id", "sampler", *common, "--max-iterations", str(n),
         "--msg-size", str(size), "--stats-file", str(tmp / "sampler.json"),
         "--channel-config", f"name=data,type=push,method=connect,address={data},{cfg}",
         "--channel-config", f"name=data-ack,type=pull,method=connect,address={ack}"]
    )  # fmt: skip
    if sampler.wait(300) or sink.wait(300):
        raise RuntimeError(f"evflow devices failed ({sampler.returncode}, {sink.returncode})")
    got = json.loads((tmp / "sink.json").read_text())["sink"]
    sent = json.loads((tmp / "sampler.json").read_text())["sampler"]
    if got["received"] != n:
        raise RuntimeError(f"sink received {got['received']} of {n}")
    return float(got["msg_per_s"]), float(got["cpu_s"]) + float(sent["cpu_s"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0, help="target time per run (s)")
    parser.add_argument("--transports", default="ipc,tcp")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="bytes, comma-separated")
    parser.add_argument("--repeat", type=int, default=3, help="best of R runs of each")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="evb-"))
    os.environ["EVFLOW_RUNTIME_DIR"] = str(tmp)
    print(
        f"{'transport':9} {'size':>7} {'N':>7} {'raw msg/s':>10} {'raw GB/s':>8} "
        f"{'evf msg/s':>10} {'evf GB/s':>8} {'ratio':>5} {'raw CPU':>8} {'evf CPU':>8} "
        f"{'CPU ratio':>9}"
    )
    try:
        for transport in args.transports.split(","):
            for size in map(int, args.sizes.split(",")):
                n = max(50, int(GUESS_MSG_S.get(size, 1000) * args.seconds))
                raws, ours = [], []
                for _ in range(args.repeat):  # interleaved: both see the same machine load
                    raws.append(run_raw(transport, tmp, n, size))
                    ours.append(run_evflow(transport, tmp, n, size))
                raw, evf = max(r[0] for r in raws), max(o[0] for o in ours)
                # CPU microseconds per message, both processes together (best run)
                raw_cpu = min(r[1] for r in raws) / n * 1e6
                evf_cpu = min(o[1] for o in ours) / n * 1e6
                print(
                    f"{transport:9} {_size(size):>7} {n:>7} {raw:>10,.0f} "
                    f"{raw * size / 1e9:>8.3f} {evf:>10,.0f} {evf * size / 1e9:>8.3f} "
                    f"{evf / raw:>5.2f} {raw_cpu:>6.1f}us {evf_cpu:>6.1f}us "
                    f"{raw_cpu / evf_cpu:>9.2f}",
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
