"""An agent's share of a path run across hosts: the workers placed on its host.

``evflow agent ... --steering FILE [--steering-argv JSON] [--cwd DIR]`` hands the agent
a :class:`PathRunShare` (the agent, in topology/, knows nothing of path runs): it loads
the steering file before the agent's zygote forks (:func:`load_split`): the file runs as
``__main__`` with ``workers=1``, and its first parallel ``evflow.process`` call hands
over its split path instead of running (``tcpwire.SplitCaptured``). The hosts share
the controller's filesystem (the file, its modules and its data paths must be at the
same place there). Workers are then forks of the zygote with the user's modules
loaded, exactly as on one host.

Commands (on the agent's bus, from the run's caller):

- ``spawn-workers {workers: [names], endpoints: {events, results, ctl}, event_buffer,
  session}`` forks each worker (never restarted here: the caller decides a
  replacement, with a new name, after telling the input WORKER_LOST); with keys, its
  tcp sockets are CURVE through the farm keys of the agent's environment;
- ``kill-worker {name}``: SIGKILL (the input's event timeout).

A worker's exit is in the agent's next heartbeat (sent at once on an exit).
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from typing import Any

from evflow.errors import ConfigurationError, SteeringError


def load_split(file: str, argv: list[str], cwd: str | None) -> None:
    """Run the steering file up to its first parallel run; install that split path."""
    from evflow.processing.parallel import currentsplit, tcpwire
    from evflow.processing.parallel.run.engine import _preload
    from evflow.processing.steering import run_steering

    if cwd:
        try:
            os.chdir(cwd)
        except OSError as exc:
            raise ConfigurationError(
                f"cannot enter the run's directory {cwd!r} on this host ({exc.strerror}); "
                "path runs across hosts need a shared filesystem"
            ) from None
    tcpwire.CAPTURE = True
    try:
        run_steering(file, {"workers": 1, "quiet": True}, argv=argv)
    except tcpwire.SplitCaptured as captured:
        currentsplit.set_current(captured.split)
        _preload(captured.split)
        return
    finally:
        tcpwire.CAPTURE = False
    raise SteeringError(f"steering file {file!r} made no parallel run on this host")


def remote_worker(
    session: str,
    name: str,
    event_buffer: int,
    endpoints: dict[str, str],
) -> int:
    """A worker forked by the agent: the engine's worker, its channels over tcp."""
    from evflow.processing.parallel import tcpwire
    from evflow.processing.parallel.worker.worker import worker_main

    tcpwire.CONNECT = dict(endpoints)  # CURVE: the farm keys of the agent's environment
    return worker_main(session, name, event_buffer)


class PathWorkers:
    """The agent's handlers for a path run's workers (see the module docstring)."""

    def __init__(self, agent: Any) -> None:
        self.agent = agent

    def spawn(self, args: dict[str, Any]) -> dict[str, Any]:
        names = args.get("workers")
        endpoints = args.get("endpoints")
        if not isinstance(names, list) or not isinstance(endpoints, dict):
            raise ConfigurationError("spawn-workers needs workers and endpoints")
        for key in ("events", "results", "ctl"):
            if not str(endpoints.get(key, "")).startswith("tcp://"):
                raise ConfigurationError(f"spawn-workers: endpoint {key!r} is not tcp")
        buffer = int(args.get("event_buffer", 4))
        sup = self.agent.sup
        pids = {}
        for name in names:
            name = str(name)
            if name in sup.processes:
                pids[name] = sup.processes[name].pid
                continue  # a re-sent request is not repeated
            proc = sup.add_function(
                name,
                remote_worker,
                self.agent.local_session,
                name,
                buffer,
                {k: str(endpoints[k]) for k in ("events", "results", "ctl")},
                restart="never",
                grace_s=1.0,
            )
            pids[name] = proc.pid
            self.agent.devices[name] = {"pid": proc.pid, "state": "running", "restarts": 0}
        self.agent._next_beat = 0.0
        return {"node_id": self.agent.node_id, "pids": pids}

    def kill(self, args: dict[str, Any]) -> dict[str, Any]:
        name = str(args.get("name", ""))
        proc = self.agent.sup.processes.get(name)
        if proc is not None and proc.state == "running" and proc.pid:
            os.kill(proc.pid, signal.SIGKILL)
        return {"node_id": self.agent.node_id}


class PathRunShare:
    """What an agent does for a path run (its extension): load the steering file
    before its zygote forks, then answer ``spawn-workers`` and ``kill-worker``."""

    def __init__(self, file: str, argv: list[str], cwd: str | None) -> None:
        self.file, self.argv, self.cwd = file, argv, cwd

    def before_fork(self) -> None:
        load_split(self.file, self.argv, self.cwd)

    def handlers(self, agent: Any) -> dict[str, Callable[[dict[str, Any]], dict[str, Any]]]:
        workers = PathWorkers(agent)
        return {"spawn-workers": workers.spawn, "kill-worker": workers.kill}


def parse_argv(text: str | None) -> list[str]:
    if not text:
        return []
    value = json.loads(text)
    if not isinstance(value, list):
        raise ConfigurationError("--steering-argv must be a JSON list of strings")
    return [str(v) for v in value]
