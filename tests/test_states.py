"""The state machine table: every valid and every invalid transition, observers, errors."""

from __future__ import annotations

import itertools
import logging

import pytest

from evflow.errors import StateTransitionError
from evflow.runtime.states import (
    AUTO_STATES,
    SHUTDOWN_STEP,
    TRANSITION_TABLE,
    State,
    StateMachine,
    Transition,
    next_state,
    parse_transition,
)

VALID = {(s, t): n for s, t, n in TRANSITION_TABLE}


def machine_in(state: State) -> StateMachine:
    fsm = StateMachine("t")
    fsm._state = state  # direct set: we test each row on its own
    return fsm


def test_table_is_fairmqs() -> None:
    expected = {
        ("IDLE", "INIT_DEVICE", "INITIALIZING_DEVICE"),
        ("IDLE", "END", "EXITING"),
        ("INITIALIZING_DEVICE", "COMPLETE_INIT", "INITIALIZED"),
        ("INITIALIZED", "BIND", "BINDING"),
        ("INITIALIZED", "RESET_DEVICE", "RESETTING_DEVICE"),
        ("BINDING", "AUTO", "BOUND"),
        ("BOUND", "CONNECT", "CONNECTING"),
        ("BOUND", "RESET_DEVICE", "RESETTING_DEVICE"),
        ("CONNECTING", "AUTO", "DEVICE_READY"),
        ("DEVICE_READY", "INIT_TASK", "INITIALIZING_TASK"),
        ("DEVICE_READY", "RESET_DEVICE", "RESETTING_DEVICE"),
        ("INITIALIZING_TASK", "AUTO", "READY"),
        ("READY", "RUN", "RUNNING"),
        ("READY", "RESET_TASK", "RESETTING_TASK"),
        ("RUNNING", "STOP", "READY"),
        ("RESETTING_TASK", "AUTO", "DEVICE_READY"),
        ("RESETTING_DEVICE", "AUTO", "IDLE"),
    }
    assert {(s.name, t.name, n.name) for s, t, n in TRANSITION_TABLE} == expected


@pytest.mark.parametrize(("start", "transition"), list(VALID))
def test_every_valid_transition_is_taken(start: State, transition: Transition) -> None:
    fsm = machine_in(start)
    seen = []
    fsm.subscribe(lambda old, new, tr: seen.append((old, new, tr)))
    assert fsm.change_state(transition) is True
    assert fsm.state is VALID[(start, transition)]
    assert seen == [(start, VALID[(start, transition)], transition)]


INVALID = [
    (s, t)
    for s, t in itertools.product(State, Transition)
    if (s, t) not in VALID and t is not Transition.ERROR_FOUND
]


@pytest.mark.parametrize(("start", "transition"), INVALID)
def test_every_invalid_transition_is_refused_and_logged(
    start: State, transition: Transition, caplog: pytest.LogCaptureFixture
) -> None:
    fsm = machine_in(start)
    with caplog.at_level(logging.WARNING, "evflow.states"):
        assert fsm.change_state(transition) is False
    assert fsm.state is start
    assert f"no transition from {start} on {transition}" in caplog.text
    with pytest.raises(StateTransitionError, match=f"no transition from {start} on {transition}"):
        fsm.change_state_or_raise(transition)
    assert fsm.state is start


def test_invalid_transition_count_covers_the_whole_product() -> None:
    assert len(INVALID) + len(VALID) + len(State) == len(State) * len(Transition)


@pytest.mark.parametrize("start", list(State))
def test_error_found_reaches_error_from_every_state(start: State) -> None:
    fsm = machine_in(start)
    fsm.change_state_or_raise(Transition.ERROR_FOUND)
    assert fsm.state is State.ERROR


def test_the_error_names_the_allowed_transitions() -> None:
    with pytest.raises(StateTransitionError, match="allowed from IDLE: END, INIT_DEVICE"):
        StateMachine("dev").change_state_or_raise(Transition.RUN)


def test_ing_states_are_the_auto_ones() -> None:
    assert {s.name for s in AUTO_STATES} == {
        "BINDING",
        "CONNECTING",
        "INITIALIZING_TASK",
        "RESETTING_TASK",
        "RESETTING_DEVICE",
    }


def test_shutdown_steps_lead_from_every_resting_state_to_exiting() -> None:
    for start in State:
        state, steps = start, 0
        while state not in (State.EXITING, State.ERROR) and steps < 20:
            step = SHUTDOWN_STEP[state]
            if step is None:
                assert state in AUTO_STATES
                step = Transition.AUTO
            nxt = next_state(state, step)
            assert nxt is not None, (state, step)
            state, steps = nxt, steps + 1
        assert state in (State.EXITING, State.ERROR), start


def test_failing_observer_does_not_break_the_machine(caplog: pytest.LogCaptureFixture) -> None:
    fsm = StateMachine("obs")

    def bad(old: State, new: State, tr: Transition) -> None:
        raise RuntimeError("boom")

    got: list[State] = []
    fsm.subscribe(bad)
    fsm.subscribe(lambda old, new, tr: got.append(new))
    assert fsm.change_state(Transition.INIT_DEVICE)
    assert got == [State.INITIALIZING_DEVICE]
    fsm.unsubscribe(bad)
    assert "observer" in caplog.text


def test_parse_transition_accepts_names_and_refuses_others() -> None:
    assert parse_transition("run") is Transition.RUN
    assert parse_transition("reset-task") is Transition.RESET_TASK
    with pytest.raises(StateTransitionError, match="unknown transition 'jump'"):
        parse_transition("jump")
