"""A device for tests (run as ``_pause_device:PauseDevice`` with tests/ on PYTHONPATH).

It prints ``STATE <name>`` on stdout for every state it enters and sleeps
``EVFLOW_TEST_PAUSE_S`` in the state named by ``EVFLOW_TEST_PAUSE_STATE`` (IDLE: while
it is being built), so that a test can signal it while it is in that state, and
``LOOP`` when its RUNNING loop first calls ``conditional_run``. With
``EVFLOW_TEST_FAIL_HOOK`` set, that hook raises.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from evflow.runtime.device import Device

PAUSE_STATE = os.environ.get("EVFLOW_TEST_PAUSE_STATE", "")
PAUSE_S = float(os.environ.get("EVFLOW_TEST_PAUSE_S", "0.5"))
FAIL_HOOK = os.environ.get("EVFLOW_TEST_FAIL_HOOK", "")
if os.environ.get("EVFLOW_TEST_PAUSE_IMPORT_S"):
    sys.stdout.write("IMPORTING\n")
    sys.stdout.flush()
    time.sleep(float(os.environ["EVFLOW_TEST_PAUSE_IMPORT_S"]))


def _say(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


class PauseDevice(Device):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fsm.subscribe(self._entered)
        if PAUSE_STATE == "IDLE":
            _say("PAUSED IDLE")
            time.sleep(PAUSE_S)

    def _entered(self, old: Any, new: Any, transition: Any) -> None:
        _say(f"STATE {new}")
        if str(new) == PAUSE_STATE:
            _say(f"PAUSED {new}")
            time.sleep(PAUSE_S)

    def _maybe_fail(self, hook: str) -> None:
        if hook == FAIL_HOOK:
            raise RuntimeError(f"test failure in {hook}")

    def init(self) -> None:
        self._maybe_fail("init")

    def bind(self) -> None:
        self._maybe_fail("bind")

    def connect(self) -> None:
        self._maybe_fail("connect")

    def init_task(self) -> None:
        self._maybe_fail("init_task")

    def pre_run(self) -> None:
        self._maybe_fail("pre_run")

    def conditional_run(self) -> bool:
        if not self.iterations:
            _say("LOOP")  # a test waits for this to signal the device inside its loop
        time.sleep(0.01)  # with --max-iterations the RUNNING loop ends by itself
        return True

    def post_run(self) -> None:
        self._maybe_fail("post_run")

    def reset_task(self) -> None:
        self._maybe_fail("reset_task")

    def reset(self) -> None:
        self._maybe_fail("reset")
