"""What the controller knows about each device and host, and the desired state.

Device states come from the devices (STATE messages, check-state replies, metrics),
process outcomes from the agents' heartbeats (``running``, ``done``, ``failed``,
``restarting``, ``stopped``), host liveness from heartbeat times. ``violations()``
compares the losses with each group's ``n_min`` / ``expendable``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from evflow.runtime.states import State
from evflow.topology.resolve import Group, ResolvedDevice

#: how far each state is along FairMQ's start-up sequence
RANK: dict[str, int] = {
    s.value: i
    for i, s in enumerate(
        (
            State.IDLE,
            State.INITIALIZING_DEVICE,
            State.INITIALIZED,
            State.BINDING,
            State.BOUND,
            State.CONNECTING,
            State.DEVICE_READY,
            State.INITIALIZING_TASK,
            State.READY,
            State.RUNNING,
        )
    )
}
ENDED = ("done", "failed", "stopped", "lost")


@dataclass
class DeviceRecord:
    spec: ResolvedDevice
    state: str = "STARTING"
    rank: int = -1  # the furthest start-up state seen
    process: str = "starting"  # running, restarting, done, failed, stopped, lost
    pid: int | None = None
    returncode: int | None = None
    message: str = ""
    error: str | None = None
    msg_in_hz: float = 0.0
    msg_out_hz: float = 0.0
    summary: dict[str, Any] = field(default_factory=dict)
    restarts: int = 0
    #: it ended while its agent shut down (the controller's stop, SIGKILL after the
    #: grace for one that hung): a consequence of the stop, not a loss of its own
    stopped_at_shutdown: bool = False
    #: restarted by its agent: to be walked to RUNNING again (``next_step_s``: resend time,
    #: ``step_rank``: its rank when the last step went, so a reported move goes on at once)
    rewalk: bool = False
    next_step_s: float = 0.0
    step_rank: int = -2
    #: pids of its dead processes: a word of theirs that arrives late (a STATE or
    #: METRICS still in the bus proxy) must not count as the new process's
    old_pids: set[int] = field(default_factory=set)

    def from_old_process(self, pid: Any) -> bool:
        return isinstance(pid, int) and pid in self.old_pids

    @property
    def id(self) -> str:
        return self.spec.id

    @property
    def host(self) -> str:
        return self.spec.host

    @property
    def ended(self) -> bool:
        return self.process in ENDED

    @property
    def lost(self) -> bool:
        """Gone without a clean exit (killed, crashed, ERROR, or its host lost); not
        a device its agent stopped while shutting down (``killed_at_shutdown``)."""
        if self.process == "stopped" and self.stopped_at_shutdown:
            return False
        return self.process in ("failed", "lost") or (
            self.process in ("done", "stopped") and self.returncode not in (0, None)
        )

    @property
    def killed_at_shutdown(self) -> bool:
        """Stopped by its agent's shutdown without a clean exit (it hung past the grace,
        e.g. waiting for a peer that was lost): reported as stopped, not as lost."""
        return (
            self.process == "stopped"
            and self.stopped_at_shutdown
            and self.returncode not in (0, None)
        )

    def see_state(self, state: str) -> None:
        self.state = state
        self.rank = max(self.rank, RANK.get(state, -1))

    def row(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "host": self.host,
            "state": self.state,
            "process": self.process,
            "pid": self.pid,
            "returncode": self.returncode,
            "msg_in_hz": round(self.msg_in_hz, 1),
            "msg_out_hz": round(self.msg_out_hz, 1),
            "restarts": self.restarts,
            "error": self.error,
            "stopped_at_shutdown": self.killed_at_shutdown,
        }


@dataclass
class HostRecord:
    name: str
    last_beat_s: float | None = None
    lost: bool = False
    exited: bool = False
    pid: int | None = None
    preflight: dict[str, Any] = field(default_factory=dict)
    #: a silent agent is pinged once before it is called lost (a dropped heartbeat)
    probe_until_s: float | None = None
    #: when it was declared lost, and when its agent, heard again after that (a cut
    #: link that came back), was last told to kill its devices and exit
    lost_at_s: float | None = None
    fenced_at_s: float | None = None


def violations(groups: list[Group], records: dict[str, DeviceRecord]) -> list[str]:
    """One line per group whose losses the desired state does not allow."""
    out = []
    for group in groups:
        if group.expendable:
            continue
        alive = sum(1 for copy in group.copies if not any(records[d].lost for d in copy))
        if alive < group.n_min:
            lost = [d for copy in group.copies for d in copy if records[d].lost]
            shown = ", ".join(lost[:8]) + (f" and {len(lost) - 8} more" if len(lost) > 8 else "")
            out.append(
                f"{group.name} needs n_min={group.n_min} cop{'y' if group.n_min == 1 else 'ies'}"
                f", {alive} left (lost: {shown})"
            )
    return out
