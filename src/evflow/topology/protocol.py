"""What the controller, the agents and the devices of a topology say on the control bus.

All of it rides on the bus's COMMAND / REPLY / STATE / METRICS messages
(:mod:`evflow.runtime.bus`); ``to`` may be a node id, a list of ids or ``"*"``.

Node ids: the controller is ``controller``, the agent of host H is ``agent.H`` (device
ids cannot contain a dot), devices use their resolved ids (``sampler_3``).

controller -> agent (COMMAND, REPLY expected)
    ``spawn {devices: [resolved device], connect_timeout_s, stats_dir}`` -> ``{pids}``;
    ``shutdown {grace_s}``: stop every device (bus END, then SIGKILL after the grace),
    remove the host's ipc files and shm segments, exit. ``shutdown {grace_s, kill:
    true}``: SIGKILL every device at once (sent to an agent heard again after its host
    was declared lost: its devices stay lost and must not end their streams).
controller -> agents (COMMAND, no answer needed)
    ``heartbeat {}`` every CONTROLLER_BEAT_S: an agent that hears none for
    CONTROLLER_LOST_S stops its devices and exits (the controller is gone). Every
    device decodes every command too (to see whether it is addressed), so this one is
    rare: once a second, not four times.
agent -> controller (METRICS, every HEARTBEAT_S and at once on a device exit)
    ``{from: agent.H, metrics: {..., agent: {host, session, pid, preflight,
    devices: {id: {pid, state, returncode, message, restarts}}}}}``; silence for
    HOST_LOST_S, then no answer to a ``ping`` within PROBE_S, means the host is lost.
controller -> devices (COMMAND)
    ``transition {transition}`` (the bus's own; a restarted device's BIND also carries
    ``properties``: the endpoints it bound before), ``set-properties {properties:
    {"dev.chan": [endpoints]}}``, ``peer-lost {peer}`` (stop waiting for its END).
device -> controller (a REPLY without ``req`` to ``controller``, fire and forget: only
    the controller subscribes to replies, while a COMMAND would wake every device; the
    controller also reads endpoints from check-state replies, so a lost one costs a
    round trip, not the run)
    ``set-property {endpoints: {"dev.chan": [endpoints]}}`` right after binding;
    ``get-properties {keys}`` while a connecting channel waits for its peer.
device -> all (METRICS at exit): ``{from, metrics, summary, error}``.
"""

from __future__ import annotations

PROTOCOL_VERSION = 1
CONTROLLER_ID = "controller"
AGENT_PREFIX = "agent."

#: agent heartbeat period (s)
HEARTBEAT_S = 0.25
#: controller heartbeat period (s): a COMMAND, which every device wakes up for
CONTROLLER_BEAT_S = 1.0
#: a host whose agent is silent this long is pinged, and lost if the ping is not
#: answered within PROBE_S either (the goal: reported within 2 s)
HOST_LOST_S = 1.2
PROBE_S = 0.5
#: an agent that hears nothing from the controller this long stops its devices
CONTROLLER_LOST_S = 6.0
#: how long a connecting channel waits for its peer's endpoint by default (s)
CONNECT_TIMEOUT_S = 20.0

#: imported before a zygote forks when the farm uses CURVE keys (pyzmq's auth and
#: socket monitor, and through them asyncio: lazy in evflow.transport.curve)
CURVE_PRELOAD = ("zmq.auth", "zmq.utils.monitor", "evflow.transport.curve")

#: reserved names a device may not take
RESERVED_IDS = frozenset({CONTROLLER_ID, "bus"})


def agent_id(host: str) -> str:
    return f"{AGENT_PREFIX}{host}"


def host_session(session: str, host: str) -> str:
    """The session (ipc directory, shm prefix) of ``host``'s agent and its devices."""
    return f"{session}-{host}"


def walk_request(first_transition: str) -> str:
    """The request id of the start-up walk's step that begins with ``first_transition``
    (every send of a step has it: a device takes a step once)."""
    return f"walk-{first_transition}"
