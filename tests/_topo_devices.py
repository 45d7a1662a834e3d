"""Device classes for topology tests (importable as ``_topo_devices:Class``)."""

from __future__ import annotations

import time

from evflow.event import DataStore
from evflow.qc.producer import QcTask
from evflow.runtime.device import Device
from evflow.runtime.devices.sampler import Sampler


class FailsInInit(Device):
    description = "raises in init(): a broken calibration, say"

    def init(self) -> None:
        raise ValueError("calibration file /nonexistent/calib.db not found")


class FailsOnStop(Device):
    description = "runs until stopped, then fails in post_run(): a count check gone wrong"

    def conditional_run(self) -> bool:
        time.sleep(0.02)  # a busy device, at little CPU
        return True

    def post_run(self) -> None:
        raise ValueError("received 999 of 1000 announced events")


class OverAnnounces(Sampler):
    description = "a sampler whose END announces one message more than it sent"

    def post_run(self) -> None:
        self._sent[0] += 1
        super().post_run()


class SlowQc(QcTask):
    """A QC task at 5 ms per event: a producer on a loaded machine, far behind."""

    def fill(self, store: DataStore) -> None:
        time.sleep(0.005)
