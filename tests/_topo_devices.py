"""Device classes for topology tests (importable as ``_topo_devices:Class``)."""

from __future__ import annotations

from evflow.runtime.device import Device


class FailsInInit(Device):
    description = "raises in init(): a broken calibration, say"

    def init(self) -> None:
        raise ValueError("calibration file /nonexistent/calib.db not found")
