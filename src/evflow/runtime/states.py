"""The device state machine as data: states, transitions and one table (FairMQ's).

``TRANSITION_TABLE`` is laid out Start | Transition | Next like FairMQ's
``transition_table``. ``AUTO`` rows are taken by the machine itself when the work of an
``-ING`` state is done (FairMQ's internal Auto event); users cannot request ``AUTO``.
``ERROR_FOUND`` is accepted from every state. The machine does no work itself: the
device runs the hooks, the machine only says what is allowed and tells observers.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from enum import Enum

from evflow.errors import StateTransitionError

log = logging.getLogger("evflow.states")


class State(Enum):
    IDLE = "IDLE"
    INITIALIZING_DEVICE = "INITIALIZING_DEVICE"
    INITIALIZED = "INITIALIZED"
    BINDING = "BINDING"
    BOUND = "BOUND"
    CONNECTING = "CONNECTING"
    DEVICE_READY = "DEVICE_READY"
    INITIALIZING_TASK = "INITIALIZING_TASK"
    READY = "READY"
    RUNNING = "RUNNING"
    RESETTING_TASK = "RESETTING_TASK"
    RESETTING_DEVICE = "RESETTING_DEVICE"
    EXITING = "EXITING"
    ERROR = "ERROR"

    def __str__(self) -> str:
        return self.value


class Transition(Enum):
    INIT_DEVICE = "INIT_DEVICE"
    COMPLETE_INIT = "COMPLETE_INIT"
    BIND = "BIND"
    CONNECT = "CONNECT"
    INIT_TASK = "INIT_TASK"
    RUN = "RUN"
    STOP = "STOP"
    RESET_TASK = "RESET_TASK"
    RESET_DEVICE = "RESET_DEVICE"
    END = "END"
    ERROR_FOUND = "ERROR_FOUND"
    #: internal: an -ING state whose work is done moves on (never requested by users)
    AUTO = "AUTO"

    def __str__(self) -> str:
        return self.value


S, T = State, Transition

# fmt: off
#  Start                  Transition         Next
TRANSITION_TABLE: tuple[tuple[State, Transition, State], ...] = (
    (S.IDLE,                T.INIT_DEVICE,     S.INITIALIZING_DEVICE),
    (S.IDLE,                T.END,             S.EXITING),
    (S.INITIALIZING_DEVICE, T.COMPLETE_INIT,   S.INITIALIZED),
    (S.INITIALIZED,         T.BIND,            S.BINDING),
    (S.INITIALIZED,         T.RESET_DEVICE,    S.RESETTING_DEVICE),
    (S.BINDING,             T.AUTO,            S.BOUND),
    (S.BOUND,               T.CONNECT,         S.CONNECTING),
    (S.BOUND,               T.RESET_DEVICE,    S.RESETTING_DEVICE),
    (S.CONNECTING,          T.AUTO,            S.DEVICE_READY),
    (S.DEVICE_READY,        T.INIT_TASK,       S.INITIALIZING_TASK),
    (S.DEVICE_READY,        T.RESET_DEVICE,    S.RESETTING_DEVICE),
    (S.INITIALIZING_TASK,   T.AUTO,            S.READY),
    (S.READY,               T.RUN,             S.RUNNING),
    (S.READY,               T.RESET_TASK,      S.RESETTING_TASK),
    (S.RUNNING,             T.STOP,            S.READY),
    (S.RESETTING_TASK,      T.AUTO,            S.DEVICE_READY),
    (S.RESETTING_DEVICE,    T.AUTO,            S.IDLE),
)
# fmt: on

_NEXT: dict[tuple[State, Transition], State] = {(s, t): n for s, t, n in TRANSITION_TABLE}

#: states that leave by themselves (AUTO) once their hook has run
AUTO_STATES: frozenset[State] = frozenset(s for s, t, _ in TRANSITION_TABLE if t is T.AUTO)

#: the orderly way out of each state (FairMQ's shutdown sequence: STOP, RESET_TASK,
#: RESET_DEVICE, END); -ING states finish their work first (None = nothing to request)
SHUTDOWN_STEP: dict[State, Transition | None] = {
    S.IDLE: T.END,
    S.INITIALIZING_DEVICE: T.COMPLETE_INIT,
    S.INITIALIZED: T.RESET_DEVICE,
    S.BOUND: T.RESET_DEVICE,
    S.DEVICE_READY: T.RESET_DEVICE,
    S.READY: T.RESET_TASK,
    S.RUNNING: T.STOP,
    S.BINDING: None,
    S.CONNECTING: None,
    S.INITIALIZING_TASK: None,
    S.RESETTING_TASK: None,
    S.RESETTING_DEVICE: None,
    S.EXITING: None,
    S.ERROR: None,
}

#: the static-control sequence: IDLE -> ... -> RUNNING
STARTUP_SEQUENCE: tuple[Transition, ...] = (
    T.INIT_DEVICE,
    T.COMPLETE_INIT,
    T.BIND,
    T.CONNECT,
    T.INIT_TASK,
    T.RUN,
)


def next_state(state: State, transition: Transition) -> State | None:
    """The state ``transition`` leads to from ``state``, or None if not allowed."""
    if transition is T.ERROR_FOUND:
        return S.ERROR
    return _NEXT.get((state, transition))


def parse_transition(text: str) -> Transition:
    """``"run"`` / ``"RUN"`` / ``"reset-task"`` -> Transition, else StateTransitionError."""
    key = text.strip().upper().replace("-", "_")
    try:
        return Transition[key]
    except KeyError:
        names = ", ".join(t.name for t in Transition if t is not T.AUTO)
        raise StateTransitionError(
            f"unknown transition {text!r}; expected one of {names}"
        ) from None


Observer = Callable[[State, State, Transition], None]


class StateMachine:
    """Current state, the table, and observers. Thread-safe; does no work itself.

    Observers are called as ``observer(old, new, transition)`` after each change, in
    the thread that made it; an observer that raises is logged and otherwise ignored.
    """

    def __init__(self, name: str = "device") -> None:
        self.name = name
        self._state = S.IDLE
        self._lock = threading.RLock()
        self._observers: list[Observer] = []

    @property
    def state(self) -> State:
        return self._state

    def __repr__(self) -> str:
        return f"<StateMachine {self.name!r} state={self._state}>"

    def subscribe(self, observer: Observer) -> None:
        self._observers.append(observer)

    def unsubscribe(self, observer: Observer) -> None:
        if observer in self._observers:
            self._observers.remove(observer)

    def change_state(self, transition: Transition) -> bool:
        """Take ``transition``; return False (and log why) when the table forbids it."""
        with self._lock:
            old = self._state
            new = next_state(old, transition)
            if new is None:
                log.warning("%s: no transition from %s on %s", self.name, old, transition)
                return False
            self._state = new
        log.debug("%s: %s --%s--> %s", self.name, old, transition, new)
        for observer in list(self._observers):
            try:
                observer(old, new, transition)
            except Exception:
                log.exception("%s: state observer %r failed", self.name, observer)
        return True

    def change_state_or_raise(self, transition: Transition) -> None:
        """Like :meth:`change_state` but raise StateTransitionError when not allowed."""
        old = self._state
        if not self.change_state(transition):
            allowed = sorted(t.name for (s, t) in _NEXT if s is old and t is not T.AUTO)
            raise StateTransitionError(
                f"{self.name}: no transition from {old} on {transition} "
                f"(allowed from {old}: {', '.join(allowed) or 'none'}, ERROR_FOUND)"
            )
