"""One hop sampler -> sink over tcp between two namespace hosts: plain, CURVE, raw pyzmq.

    sudo python benchmarks/bench_farm_hop.py [--seconds 2] [--repeat 3] [--sizes 1024,...]

Builds two hosts (network namespaces on a bridge, ``tests/farm_hosts.py``), puts the
receiver on h2 and the sender on h1 (``nsenter --net``), and runs, interleaved so all
see the same machine load, for each size:

- ``raw``: a pyzmq PUSH -> PULL loop of single frames (the ceiling);
- ``raw+curve``: the same loop with CURVE on both sockets (the cost of the cipher alone);
- ``plain``: ``evflow device sampler`` -> ``evflow device sink`` (wire-protocol
  messages, END with the count and an ACK);
- ``curve``: the same devices with ``curve=server|client`` channels and a ZAP
  allow-list (keys made by ``evflow.transport.curve.create_keys``).

Reports msg/s at the receiver (best of --repeat) and the ratios curve/plain and
plain/raw. Needs root (namespaces).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))

from bench_transport import _size, hwm_for  # noqa: E402

from evflow.transport.curve import create_keys  # noqa: E402
from farm_hosts import NamespaceFarm, missing_for_farm  # noqa: E402

SIZES = [1024, 100 * 1024, 1024**2]
GUESS_MSG_S = {1024: 60_000, 100 * 1024: 8_000, 1024**2: 1_000}

# raw loops; argv: address n size hwm [curve-dir server|client]
_CURVE = r"""
def curve(s, argv):
    if len(argv) < 6:
        return
    import zmq.auth
    d, role = argv[4], argv[5]
    pub, sec = zmq.auth.load_certificate(f"{d}/{role}.key_secret")
    s.curve_publickey, s.curve_secretkey = pub, sec
    if role == "server":
        s.curve_server = True
    else:
        s.curve_serverkey = zmq.auth.load_certificate(f"{d}/server.key")[0]
"""
RAW_RECV = (
    _CURVE
    + r"""
import sys, time, zmq
argv = sys.argv[1:]
addr, n, size, hwm = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
ctx = zmq.Context(); s = ctx.socket(zmq.PULL); s.setsockopt(zmq.RCVHWM, hwm); curve(s, argv)
s.bind(addr)
print("bound", flush=True)
copy = size < 65536
s.recv(copy=copy); t0 = time.monotonic(); c0 = time.process_time()
for _ in range(n - 1):
    s.recv(copy=copy)
print(time.monotonic() - t0, time.process_time() - c0, flush=True)
s.close(0); ctx.term()
"""
)
RAW_SEND = (
    _CURVE
    + r"""
import os, sys, time, zmq
argv = sys.argv[1:]
addr, n, size, hwm = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
ctx = zmq.Context(); s = ctx.socket(zmq.PUSH); s.setsockopt(zmq.SNDHWM, hwm); curve(s, argv)
s.connect(addr)
payload = os.urandom(size); copy = size < 65536
if not copy:
    payload = zmq.Frame(payload)
c0 = time.process_time()
for _ in range(n):
    s.send(payload, copy=copy)
time.sleep(0.2)  # the I/O thread's last sends (and their encryption) count too
print(time.process_time() - c0, flush=True)
sys.stdin.readline()  # the receiver is done: closing now cannot lose anything
s.close(0); ctx.term()
"""
)


class Hop:
    def __init__(self, farm: NamespaceFarm, keys: Path, tmp: Path) -> None:
        self.farm = farm
        self.keys = keys
        self.tmp = tmp
        self.port = 41000

    def _in(self, host: str) -> list[str]:
        return ["nsenter", f"--net={self.farm.hosts[host].netns_path}"]

    def _address(self) -> str:
        self.port += 1
        return f"tcp://{self.farm.hosts['h2'].address}:{self.port}"

    def raw(self, n: int, size: int, curve: bool) -> tuple[float, float]:
        """(msg/s at the receiver, CPU us per message of sender + receiver)."""
        addr = self._address()
        argv = [addr, str(n), str(size), str(hwm_for(size))]
        extra = [str(self.keys)] if curve else []
        recv = subprocess.Popen(
            [*self._in("h2"), sys.executable, "-c", RAW_RECV, *argv, *extra,
             *(["server"] if curve else [])],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert recv.stdout is not None
        recv.stdout.readline()
        send = subprocess.Popen(
            [*self._in("h1"), sys.executable, "-c", RAW_SEND, *argv, *extra,
             *(["client"] if curve else [])],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert send.stdin is not None and send.stdout is not None
        try:
            elapsed, recv_cpu = map(float, recv.stdout.readline().split())
            send_cpu = float(send.stdout.readline())
        finally:
            send.stdin.write("done\n")
            send.stdin.close()
            send.wait(60)
            recv.wait(60)
            recv.stdout.close()
            send.stdout.close()
        return n / elapsed, (recv_cpu + send_cpu) / n * 1e6

    def evflow(self, n: int, size: int, curve: bool) -> tuple[float, float]:
        """(msg/s at the sink, CPU us per message of sampler + sink while running)."""
        data, ack = self._address(), self._address()
        hwm = hwm_for(size)
        k = self.keys
        server = f",curve=server,curveSecretKey={k}/server.key_secret,curveAllow={k}"
        client = f",curve=client,curveSecretKey={k}/client.key_secret,curveServerKey={k}/server.key"
        srv, cli = (server, client) if curve else ("", "")
        evflow = [sys.executable, "-m", "evflow", "device"]
        common = ["--severity", "warn", "--session", "bench"]
        cfg = f"sndBufSize={hwm},rcvBufSize={hwm},rateLogging=0"
        sink = subprocess.Popen(
            [*self._in("h2"), *evflow, "sink", "--id", "sink", *common,
             "--read-payload", "false",  # a hop's cost, as the raw loop: bytes unread
             "--stats-file", str(self.tmp / "sink.json"),
             "--channel-config", f"name=data,type=pull,method=bind,address={data},{cfg}{srv}",
             "--channel-config", f"name=data-ack,type=push,method=bind,address={ack}{srv}"]
        )  # fmt: skip
        sampler = subprocess.Popen(
            [*self._in("h1"), *evflow, "sampler", "--id", "sampler", *common,
             "--max-iterations", str(n), "--msg-size", str(size),
             "--stats-file", str(self.tmp / "sampler.json"),
             "--channel-config", f"name=data,type=push,method=connect,address={data},{cfg}{cli}",
             "--channel-config", f"name=data-ack,type=pull,method=connect,address={ack}{cli}"]
        )  # fmt: skip
        if sampler.wait(300) or sink.wait(300):
            raise RuntimeError(f"devices failed ({sampler.returncode}, {sink.returncode})")
        got = json.loads((self.tmp / "sink.json").read_text())["sink"]
        sent = json.loads((self.tmp / "sampler.json").read_text())["sampler"]
        if got["received"] != n:
            raise RuntimeError(f"sink received {got['received']} of {n}")
        return float(got["msg_per_s"]), (float(got["cpu_s"]) + float(sent["cpu_s"])) / n * 1e6


def cipher_gb_s(size: int = 1024**2, rounds: int = 30) -> float:
    """GB/s of CURVE's cipher (libsodium's crypto_box_afternm, XSalsa20-Poly1305) on one
    core, from the libsodium that pyzmq's libzmq uses: the ceiling of one CURVE stream."""
    import ctypes
    import glob
    import time

    import zmq

    libs = glob.glob(str(Path(zmq.__file__).parents[1] / "pyzmq.libs" / "libsodium*"))
    if not libs:
        return float("nan")
    sodium = ctypes.CDLL(libs[0])
    sodium.sodium_init()
    plain = ctypes.create_string_buffer(bytes(32) + os.urandom(size), size + 32)
    out = ctypes.create_string_buffer(size + 32)
    key, nonce = ctypes.create_string_buffer(os.urandom(32), 32), ctypes.create_string_buffer(24)
    t0 = time.process_time()  # CPU time: what the cipher costs, whatever else runs
    for _ in range(rounds):
        sodium.crypto_box_afternm(out, plain, ctypes.c_ulonglong(size + 32), nonce, key)
    return size * rounds / (time.process_time() - t0) / 1e9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0, help="target time per run (s)")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="bytes, comma-separated")
    parser.add_argument("--repeat", type=int, default=3, help="best of R runs of each")
    args = parser.parse_args()
    reason = missing_for_farm()
    if reason:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="evb-hop-"))
    os.environ["EVFLOW_RUNTIME_DIR"] = str(tmp)
    create_keys(tmp / "keys", ["server", "client"])
    print(f"CURVE cipher on one core (libsodium XSalsa20-Poly1305, 1 MB): {cipher_gb_s():.2f} GB/s")
    modes = ("raw", "raw+curve", "plain", "curve")
    head = f"{'size':>7} {'N':>6} " + " ".join(f"{m + ' msg/s':>15}" for m in modes)
    print(head + f" {'curve/plain':>11} {'plain/raw':>9}   CPU us/msg: "
          + " ".join(f"{m:>9}" for m in modes) + f" {'CPU plain/curve':>15}")  # fmt: skip
    try:
        with NamespaceFarm(2) as farm:
            hop = Hop(farm, tmp / "keys", tmp)
            for size in map(int, args.sizes.split(",")):
                n = max(50, int(GUESS_MSG_S.get(size, 1000) * args.seconds))
                rate = dict.fromkeys(modes, 0.0)
                cpu = dict.fromkeys(modes, float("inf"))
                for _ in range(args.repeat):  # interleaved: all see the same machine load
                    for mode in modes:
                        curve = mode.endswith("curve")
                        run = hop.raw if mode.startswith("raw") else hop.evflow
                        msg_s, cpu_us = run(n, size, curve=curve)
                        rate[mode] = max(rate[mode], msg_s)
                        cpu[mode] = min(cpu[mode], cpu_us)
                print(
                    f"{_size(size):>7} {n:>6} "
                    + " ".join(f"{rate[m]:>15,.0f}" for m in modes)
                    + f" {rate['curve'] / rate['plain']:>11.2f} {rate['plain'] / rate['raw']:>9.2f}"
                    + "               "
                    + " ".join(f"{cpu[m]:>9.1f}" for m in modes)
                    + f" {cpu['plain'] / cpu['curve']:>15.2f}",
                    flush=True,
                )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
