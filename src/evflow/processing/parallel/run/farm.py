"""A path run whose workers are on other hosts (``hosts=``): the caller's side.

The input and the output run here as in every parallel run (engine.py's ``Parent``);
this subclass only moves the workers. It binds the run's ``events``, ``results`` and
``ctl`` channels on tcp too (tcpwire.py), starts one agent per host through a launcher
(``evflow agent --steering FILE``: the agent loads the steering file, its zygote forks
the workers), and tells each agent over a tcp control bus which workers to fork and
where the three endpoints are.

Failures:

- a worker that dies on a live host is reaped by its agent, whose next heartbeat (at
  once) says so: the input gets WORKER_LOST (its unconfirmed events go again) and the
  agent forks a replacement under the next name, as on one host;
- a host whose agent is silent for ``host_lost_s`` (default 1.2 s), or whose launcher
  process ended, is lost: WORKER_LOST for each of its workers (nobody charged: the
  events were not at fault), so their events go to the other hosts; the agent is ended
  and started again every ``rejoin_s``; when it answers, the host rejoins with new workers.
- an agent that ends before it was first heard was never in the pool: it is a failed
  start (one line, started again every ``rejoin_s``), as an unreachable host.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import zmq

from evflow.errors import ConfigurationError, PeerLostError
from evflow.processing.options import ProcessOptions
from evflow.processing.parallel import scoreboard, tcpwire
from evflow.processing.parallel.notices import say, stopping_line
from evflow.processing.parallel.run.engine import Parent
from evflow.processing.parallel.run.farmplan import plan_hosts
from evflow.processing.parallel.split import SplitPath
from evflow.topology.keypolicy import farm_security, refusal_line
from evflow.transport.farmkeys import ENV_CONTROLLER, ENV_HOST, ENV_HOSTS_FILE, ENV_KEYS, key_names
from evflow.wire.messages import MsgType, encode_message

#: default silence (s) after which a host counts as lost (the issue's bound: <= 2 s)
HOST_LOST_S = 1.2
#: controller heartbeat period (s): an agent that hears none for a while stops
BEAT_S = 0.25
#: a lost host's agent is started again after this long (s)
REJOIN_S = 1.0


class _Host:
    def __init__(self, spec: Any, slots: list[int]) -> None:
        self.spec = spec
        self.slots = slots  # global worker indices placed here
        self.handle: Any = None
        self.starting: threading.Thread | None = None
        self.start_error = ""
        self.last_beat_s: float | None = None
        self.alive = False
        self.spawned = False
        self.workers: dict[str, int] = {}  # live worker name -> pid (0: not yet known)
        self.lost_at = 0.0
        self.losses = 0
        self.launches = 0
        self.ever_up = False  # heard at least once
        self.retry = False  # lost or its start failed: started again every rejoin_s
        self.told = ""  # the last start error said on stderr
        self.refused = ""  # why the run's CURVE keys refused its agent: out of the run
        self.agent = spec.name  # its agent's name: a restarted agent gets NAME.N

    def next_agent(self) -> str:
        """A fresh name for a restarted agent: an old one heard again is told apart."""
        self.launches += 1
        n = self.launches - 1
        self.agent = f"{self.spec.name}.{n}" if n else self.spec.name
        return self.agent


class FarmParent(Parent):
    """``Parent`` with its workers on other hosts (see the module docstring)."""

    def __init__(self, split: SplitPath, options: ProcessOptions) -> None:
        self.hosts_spec, counts = plan_hosts(options)
        if options.transport == "shm":
            raise ConfigurationError("transport shm needs one host; hosts runs use tcp")
        total = sum(counts.values())
        super().__init__(split, options.replace(workers=total))
        # the run's ipc secret (transport/security.py) checks the kernel's credentials of
        # a peer forked by our own zygote: remote workers are neither. Their sockets are
        # on tcp, protected by the farm's CURVE keys (docs/farm_paths.md)
        self.ipc_auth = False
        # remote workers' pids are not siblings of the input (input/input.py's HELLO check)
        self.role_options["remote_workers"] = True
        extra = options.extra or {}
        self.host_lost_s = float(extra.get("host_lost_s", HOST_LOST_S))
        self.rejoin_s = float(extra.get("rejoin_s", REJOIN_S))
        self.launcher_name = options.launcher
        self.farm: dict[str, _Host] = {}
        index = 0
        for name, n in counts.items():
            self.farm[name] = _Host(self.hosts_spec[name], list(range(index, index + n)))
            index += n
        self.host_of: dict[str, str] = {}  # worker name -> host
        self.endpoints: dict[str, str] | None = None
        self.lost_hosts: list[str] = []
        self.lost_workers_of: dict[str, list[str]] = {}
        self._next_beat = 0.0
        self._last_tick = time.monotonic()
        self._seq = 0
        # the one key policy of `evflow up` too (topology/keypolicy.py): keys, or plaintext
        # across hosts only with --insecure; a host without a public key is refused
        # when it connects, and the run goes on without it
        self.hosts_written = isinstance(options.hosts, dict)  # hosts={...}: a file at start
        self.curve = farm_security(
            topology_name="", launcher=options.launcher,
            hosts={n: self.hosts_spec[n] for n in self.farm},
            hosts_file="hosts=" if self.hosts_written else str(options.hosts),
            keys_dir=None, insecure=options.insecure, what="the path run",
            warn=lambda text: print(f"evflow: warning: {text}", file=sys.stderr),
            hosts_keys=False,
        )  # fmt: skip
        self.key_by_address: dict[str, str] = {}

    # --- life cycle ---------------------------------------------------------------------
    def run(self) -> Any:
        from evflow.topology.startup import route_source

        first = next(iter(self.farm.values())).spec.address
        self.address = route_source(first)
        restore = self._curve_env() if self.curve else dict
        tcpwire.BIND_ADDRESS = self.address  # before the zygote forks the roles
        try:
            return super().run()
        finally:
            tcpwire.BIND_ADDRESS = None
            restore()

    def _curve_env(self) -> Any:
        """The farm keys in our environment for the run (every role inherits them):
        our pair is the one the key policy gives our address (farmkeys.key_names)."""
        assert self.curve is not None
        self.curve.addresses = {n: h.address for n, h in self.hosts_spec.items()}
        self.curve.controller_addresses = [self.address]
        _, self.key_by_address = key_names(self.curve.addresses, [self.address])
        written = None
        if self.hosts_written:  # hosts= given as a dict: its addresses go to a file
            from evflow.transport.paths import runtime_base_dir

            lines = ["[hosts]"]
            lines += [f'{n} = {{ address = "{a}" }}' for n, a in self.curve.addresses.items()]
            base = runtime_base_dir()
            base.mkdir(parents=True, exist_ok=True)
            written = self.curve.hosts_file = base / f".{self.session}.hosts.toml"
            written.write_text("\n".join(lines) + "\n")
        saved = {k: os.environ.get(k) for k in (ENV_KEYS, ENV_HOST, ENV_HOSTS_FILE, ENV_CONTROLLER)}
        self.curve.apply_to_controller()

        def restore() -> None:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            if written is not None:
                written.unlink(missing_ok=True)

        return restore

    def _remote_start(self, ctx: zmq.Context[Any]) -> None:
        from evflow.runtime.bus import BusProxy
        from evflow.runtime.busclient import open_bus_sockets
        from evflow.topology.launch.base import get_launcher

        self.launcher = get_launcher(self.launcher_name)
        tcp = f"tcp://{self.address}:0"
        self.farm_proxy = BusProxy(ctx, self.session, publish_address=tcp, subscribe_address=tcp)
        self.farm_proxy.start_thread()
        topics = (MsgType.REPLY, MsgType.METRICS)
        self._pub, self._sub = open_bus_sockets(ctx, self.farm_proxy.endpoints, "parallel", topics)
        for host in self.farm.values():
            self._launch(host)

    def _launch(self, host: _Host) -> None:
        """Start the host's agent in a thread (ssh may take seconds to give up)."""
        from evflow.processing.steering import current_context

        ctx = current_context()
        main = sys.modules.get("__main__")
        file = str(ctx.file) if ctx is not None else getattr(main, "__file__", None)
        if not file:
            raise ConfigurationError(
                "hosts= needs a steering file or script: the agents import it to build "
                "the workers' path (run it with `evflow run FILE` or `python FILE`)"
            )
        bus = self.farm_proxy.endpoints
        args = ["--bus", f"{bus.publish},{bus.subscribe}", "--session", self.session,
                "--host", host.next_agent(), "--steering", str(Path(file).resolve()),
                "--steering-argv", json.dumps(sys.argv[1:]), "--cwd", os.getcwd(),
                "--controller-lost-s", "4"]  # fmt: skip
        env = {k: os.environ[k] for k in ("EVFLOW_RUNTIME_DIR", "PYTHONPATH") if k in os.environ}
        if self.curve:  # the agent and its workers: CURVE clients with their host's key
            env.update(self.curve.agent_env(host.spec.name))
        host.spawned, host.alive, host.last_beat_s = False, False, None

        name = host.spec.name

        def start() -> None:
            try:
                host.handle = self.launcher.start_agent(host.spec, args, env)
            except Exception as exc:  # one line, told when the host counts as lost
                text = str(exc)
                host.start_error = text if text.startswith("host ") else f"host {name!r}: {text}"

        host.start_error = ""
        if self.launcher_name == "local":  # PDEATHSIG follows the forking thread: not a thread
            start()
            return
        host.starting = threading.Thread(target=start, daemon=True)
        host.starting.start()

    def _remote_poll(self, poller: zmq.Poller) -> None:
        poller.register(self._sub.socket, zmq.POLLIN)

    def _remote_wind_down(self) -> None:
        if hasattr(self, "farm_proxy"):
            self.farm_proxy.winding_down()

    def _remote_stop(self) -> None:
        if not hasattr(self, "_pub"):
            return
        self._command("shutdown", "*", {"grace_s": 1.0})
        for host in self.farm.values():
            if host.starting is not None:
                host.starting.join(timeout=10.0)
        ends = [threading.Thread(target=h.handle.terminate, args=(3.0,), daemon=True)
                for h in self.farm.values() if h.handle is not None]  # fmt: skip
        for t in ends:
            t.start()
        for t in ends:
            t.join(timeout=10.0)
        self._sub.close(0)
        self._pub.close(0)
        self.farm_proxy.close()
        # a host killed outright leaves its agent's session directory (shared or local
        # filesystem): its owner is dead now, so it goes, as after any dead run
        from evflow.transport.sessions import remove_stale_sessions

        remove_stale_sessions()

    # --- the bus ------------------------------------------------------------------------
    def _command(self, cmd: str, to: str, args: dict[str, Any]) -> None:
        self._seq += 1
        header = {"cmd": cmd, "to": to, "req": f"parallel-{self._seq}", "from": "parallel",
                  "ts": time.time(), "args": args}  # fmt: skip
        self._pub.send(encode_message(MsgType.COMMAND, header))

    def _remote_tick(self) -> None:
        now = time.monotonic()
        starved = now - self._last_tick > 0.6  # our own silence: judge nobody
        self._last_tick = now
        while self._sub.socket.poll(0):
            try:
                frames = self._sub.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            msg = self.bad.decode(frames)  # counts bad ones
            if msg is None:
                continue
            sender = str(msg.header.get("from", ""))
            host = self.farm.get(sender[len("agent.") :].split(".")[0]) if sender.startswith(
                "agent.") else None  # fmt: skip
            if host is None:
                continue
            if sender != f"agent.{host.agent}":  # an agent of before a loss, heard again
                self._command("shutdown", sender, {"grace_s": 0.5})
                continue
            host.last_beat_s = now
            agent = (msg.header.get("metrics") or {}).get("agent")
            if msg.type == MsgType.METRICS and isinstance(agent, dict):
                self._beat(host, agent)
        if now >= self._next_beat:
            self._next_beat = now + BEAT_S
            self._command("heartbeat", "*", {})
        if self.endpoints is None:
            self.endpoints = tcpwire.read_endpoints(self.session)
        if self.curve:
            self._check_refusals()
        for name, host in self.farm.items():
            if starved and host.last_beat_s is not None:
                host.last_beat_s = now
            self._tend_host(name, host, now)

    def _beat(self, host: _Host, agent: dict[str, Any]) -> None:
        if not host.alive:
            host.alive, host.ever_up, host.retry = True, True, False
            if host.losses:
                say(f"evflow: host {host.spec.name!r} is back: it rejoins the pool")
        devices = agent.get("devices")
        if not isinstance(devices, dict):
            return
        for name, entry in devices.items():
            if name not in host.workers or not isinstance(entry, dict):
                continue
            if isinstance(entry.get("pid"), int):
                host.workers[name] = entry["pid"]
            if entry.get("state") in ("done", "failed", "stopped"):
                code = entry.get("returncode")
                self._remote_exit(host, name, code if isinstance(code, int) else -9)

    def _check_refusals(self) -> None:
        """A host whose agent our bus refused (CURVE) is out of the run, said in one line
        that names the key at fault; if no host is left, the run ends with that line."""
        for peer, reason in self.farm_proxy.refusals():
            address = peer.rsplit(":", 1)[0] if peer.count(":") == 1 else peer
            name = self.key_by_address.get(address)
            host = self.farm.get(name or "")
            if host is None or host.alive or host.refused:
                continue
            assert self.curve is not None
            host.refused = refusal_line(host.spec.name, peer, reason, self.curve.keys_dir)
            say(f"evflow: {host.refused}; the run goes on without it")
            if host.handle is not None:
                threading.Thread(target=host.handle.terminate, args=(1.0,), daemon=True).start()
            failed = [h.refused or h.start_error for h in self.farm.values()]
            if all(failed) and not any(h.ever_up for h in self.farm.values()):
                self._fail(PeerLostError("; ".join(failed)))

    def _tend_host(self, name: str, host: _Host, now: float) -> None:
        if host.refused:
            return
        ending = self.hard or self.error is not None or self.aborting_at
        input_done = not self._alive("input")
        if host.alive:
            gone = host.handle is not None and host.handle.poll() is not None
            quiet_s = 0.0 if host.last_beat_s is None else now - host.last_beat_s
            if gone or quiet_s > self.host_lost_s:
                self._host_lost(name, host, now, "its agent ended" if gone else
                                f"no heartbeat for {quiet_s:.1f} s")  # fmt: skip
                return
            if not host.spawned and self.endpoints and not ending and not input_done:
                host.spawned = True
                names = []
                for i in host.slots:
                    worker = self._worker_name(i)
                    self.generation[i] = self.generation.get(i, 0) + 1
                    names.append(worker)
                self._spawn_remote(host, names)
            return
        starting = host.starting is not None and host.starting.is_alive()
        code = host.handle.poll() if host.handle is not None else None
        if code is not None and not starting and not host.retry and not ending:
            # started but ended before we heard it once: never in the pool, so not "lost";
            # unnoticed, the host would be left out for good (and a run of one would wait)
            # an agent that never hears the run's bus stops after --controller-lost-s
            hint = "" if code < 0 else (
                f" (did it reach the run's bus at {self.address}? is that address "
                f"reachable from {name}?)")  # fmt: skip
            host.start_error = host.start_error or (
                f"host {name!r}: its agent ended (code {code}) before it answered{hint}"
            )
        if host.start_error and not starting:
            self._start_failed(name, host, now)
            if self.error is not None:
                return
        ended = host.handle is None or host.handle.poll() is not None
        due = now - host.lost_at > self.rejoin_s
        if host.retry and due and ended and not starting and not ending and not input_done:
            host.handle = None
            host.lost_at = now
            self._launch(host)

    def _start_failed(self, name: str, host: _Host, now: float) -> None:
        """A host that cannot be reached: the run goes on with the others (and tries it
        again every rejoin_s); when no host was ever reached, one error names each."""
        failed = {n: h.start_error or h.refused for n, h in self.farm.items()
                  if h.start_error or h.refused}  # fmt: skip
        if not any(h.ever_up for h in self.farm.values()) and len(failed) == len(self.farm):
            self._fail(PeerLostError("; ".join(failed.values())))  # each names its host
            return
        if host.start_error != host.told:
            say(
                f"evflow: {host.start_error}; the run "
                f"goes on with the other hosts and tries it again every {self.rejoin_s:g} s"
            )
            host.told = host.start_error
        host.start_error, host.retry, host.lost_at = "", True, now

    def _is_role(self, name: str, pid: int) -> bool:
        # a remote worker's HELLO comes over tcp from another host's agent's fork
        return name in self.host_of or super()._is_role(name, pid)

    def _spawn_remote(self, host: _Host, names: list[str]) -> None:
        assert self.endpoints is not None
        for worker in names:
            host.workers[worker] = 0
            self.host_of[worker] = host.spec.name
        args = {"workers": names, "endpoints": self.endpoints,
                "event_buffer": self.options.event_buffer}  # fmt: skip
        self._command("spawn-workers", f"agent.{host.agent}", args)

    def _say_stopping(self) -> None:
        """The first interrupt: the workers in flight are on the hosts (no local board)."""
        live = sum(len(h.workers) for h in self.farm.values())
        say(stopping_line(self.signals[0], self.stop_grace_s, live))

    def _spawn_worker(self, index: int) -> None:
        """Workers are forked by their hosts' agents (``_tend_host``), not here."""

    def _kill_worker(self, name: str) -> None:
        host = self.host_of.get(name)
        if host is not None:
            self.timed_out.add(hash(name))
            self._command("kill-worker", f"agent.{self.farm[host].agent}", {"name": name})
            self.farm[host].workers.pop(name, None)
            self._lost(name, -9, "timeout", self._replacement(host, name))

    def _remote_exit(self, host: _Host, name: str, code: int) -> None:
        if host.workers.pop(name, None) is None or code == 0 or self.aborting_at or self.hard:
            return
        self.lost.append(name)
        self._lost(name, code, None, self._replacement(host.spec.name, name))

    def _replacement(self, host: str, name: str) -> str | None:
        if self.restarts >= self.max_restarts or not self._alive("input"):
            return None
        self.restarts += 1
        index = scoreboard.slot_of(name)
        worker = self._worker_name(index)
        self.generation[index] = self.generation.get(index, 0) + 1
        self._spawn_remote(self.farm[host], [worker])
        return worker

    def _lost(self, name: str, code: int, reason: str | None, replacement: str | None) -> None:
        lost: dict[str, Any] = {"name": name, "pid": 0, "code": code, "blame": "unknown"}
        if reason:
            lost["reason"] = reason
        if replacement:
            lost["replacement"] = replacement
        self._send("input", MsgType.WORKER_LOST, lost)

    def _host_lost(self, name: str, host: _Host, now: float, why: str) -> None:
        host.alive, host.spawned, host.lost_at, host.retry = False, False, now, True
        host.losses += 1
        self.lost_hosts.append(name)
        workers = sorted(host.workers)
        self.lost_workers_of.setdefault(name, []).extend(workers)
        self.lost.extend(workers)  # "workers lost" counts them too
        say(f"evflow: host {name!r} lost ({why}): its {len(workers)} worker(s)' events "
            "go to the other hosts")  # fmt: skip
        for worker in workers:
            # not the events' fault: nobody is charged an attempt ("idle")
            self._send("input", MsgType.WORKER_LOST,
                       {"name": worker, "pid": 0, "code": -9, "blame": "idle"})  # fmt: skip
        host.workers.clear()
        handle = host.handle
        if handle is not None:
            threading.Thread(target=handle.terminate, args=(1.0,), daemon=True).start()
        if not any(h.alive for h in self.farm.values()):
            say("evflow: every host is lost; waiting for one to come back")

    # --- the summary --------------------------------------------------------------------
    def _summary(self, wall_s: float) -> Any:
        summary = super()._summary(wall_s)
        requeued = self.results.get("input", ({}, []))[0].get("requeued") or {}
        counters = dict(summary.counters)
        counters["hosts"] = len(self.farm)
        counters["hosts lost"] = len(set(self.lost_hosts))
        counters["host losses"] = len(self.lost_hosts)
        for name in dict.fromkeys(self.lost_hosts):
            resent = sum(int(requeued.get(w, 0)) for w in self.lost_workers_of.get(name, []))
            counters[f"host {name} lost: events re-sent"] = resent
        import dataclasses

        return dataclasses.replace(summary, counters=counters)
