"""The ``qc-producer`` device: a QcTask on the events of a channel, standalone.

``evflow device qc-producer --task mymodule:MuonQc --merger ipc://qc-merger ...`` runs
the task on every event that arrives on ``data-in`` (EVENTS messages of the default
codec, single events or batches) and publishes like a task in a path. END from every
input (``inputs``, default one per sub-channel) ends the run: the last publication is
acknowledged by the merger before the device stops. Without ``--merger`` it publishes
on its ``qc-out`` channel (a DEALER connected to a merger's ``qc-in``): that is how a
topology's ``[qc.NAME]`` layers wire it (:mod:`evflow.qc.topology_tables`).
"""

from __future__ import annotations

import importlib
import json
import logging
import traceback
from typing import Any

from evflow.errors import CodecError, ConfigurationError, IncompleteStreamError
from evflow.event import DataStore, RunMeta
from evflow.params import Param
from evflow.processing.failures import SHOWN_UIDS, FailureLog
from evflow.qc.producer import QcTask
from evflow.runtime.device import Device, Origin
from evflow.runtime.devices.eventsink import decode_events
from evflow.runtime.devices.stream import EndTracker, acknowledge
from evflow.wire.messages import Message, MsgType

log = logging.getLogger("evflow.qc")

#: the DEALER to the merger when ``merger`` is not given (a topology's qc layers add it)
OUT = "qc-out"


def load_task_class(spec: str) -> type[QcTask]:
    """``module:Class`` of a QcTask subclass; ConfigurationError naming what is wrong."""
    module_name, _, class_name = spec.partition(":")
    if not module_name or not class_name:
        raise ConfigurationError(f"QC task {spec!r} is not of the form module:Class")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        raise ConfigurationError(f"QC task {spec!r} cannot be loaded: {exc}") from None
    if not (isinstance(cls, type) and issubclass(cls, QcTask)):
        raise ConfigurationError(f"QC task {spec!r} is not a subclass of evflow.qc.QcTask")
    return cls


class QcProducer(EndTracker, Device):
    description = "QC producer: a QcTask on the events of data-in, published to a merger"

    task = Param(str, "", "the QcTask class, module:Class")
    task_params = Param(str, "{}", "the task's parameters as a JSON object")
    merger = Param(str, "", "the merger's qc-in address (empty: the qc-out channel)")
    cycle_s = Param(float, 10.0, "publication cycle (s)")
    mode = Param(str, "delta", "publish deltas or full objects", choices=("delta", "full"))
    source = Param(str, "", "source id (default: the device id)")
    run_number = Param(int, 0, "run number of the publications")
    inputs = Param(int, 0, "END messages to wait for (0 = one per data-in sub-channel)")
    senders = Param(str, "", "ids whose END counts, comma-separated (empty: any sender)")
    in_channel = Param(str, "data-in", "input channel")

    def init_task(self) -> None:
        self.events_in = 0
        self.bad_events = 0
        self.task_errors = 0  # events the task's fill raised on
        self.task_failures = FailureLog()
        cls = load_task_class(self.task)
        try:
            params = json.loads(self.task_params)
        except json.JSONDecodeError as exc:
            raise ConfigurationError(
                f"device {self.id!r}: --task-params is not JSON: {exc}"
            ) from None
        if not isinstance(params, dict):
            raise ConfigurationError(f"device {self.id!r}: --task-params must be a JSON object")
        params.update(
            merger=self.merger, cycle_s=self.cycle_s, mode=self.mode,
            source=self.source or self.id, session=self.session,
        )  # fmt: skip
        self.qc_task = cls(**params)
        if not self.merger and self.has_channel(OUT):
            self.qc_task.out_channel = self.channel(OUT)
        self.qc_task.initialize()
        self.qc_task.begin_run(RunMeta(0, self.run_number))
        # [events taken]: a restarted producer knows what its dead process took
        record = self._open_record(1)
        self.taken_before = record.counts[0]
        self.events_in = record.counts[0]
        self.bad_events = 0
        self.ends = self._ends_taken()
        self._needed = self.inputs or len(self.channel_list(self.in_channel))
        self._needed -= len(self.lost_peers)
        self.on_data(self.in_channel, self._handle)
        if self._bus is not None:
            self._bus.handle("qc-set-cycle", self._set_cycle)

    def _set_cycle(self, args: dict[str, Any]) -> dict[str, Any]:
        seconds = args.get("seconds")
        if not isinstance(seconds, int | float) or isinstance(seconds, bool) or seconds <= 0:
            raise ConfigurationError(f"qc-set-cycle: seconds must be > 0, got {seconds!r}")
        self.qc_task.set_cycle_s(float(seconds))
        return {"cycle_s": float(seconds)}

    def _handle(self, msg: Message, origin: Origin) -> bool:
        if msg.type is MsgType.EVENTS:
            try:
                stores = decode_events(list(msg.payload))
            except CodecError as exc:
                self.bad_events += 1
                if self.bad_events == 1:
                    log.error("%s: undecodable events dropped (%s); more are counted", self.id, exc)
                return True
            task = self.qc_task
            for store in stores:
                try:
                    task.fill(store)
                except Exception as exc:  # user code: this event only (see _task_failed)
                    self._task_failed(store, exc)
                    task.after_event(filled=False)
                else:
                    task.after_event()
            self.events_in += len(stores)
            self.record.counts[0] = self.events_in
            return True
        if msg.type is MsgType.END:
            counts = self._track_end(msg, origin)
            if counts is None:
                return True
            if counts:
                self.ends += 1
            acknowledge(self, msg, origin, count=self.events_in)
            return self.ends < self._needed
        return True

    def _task_failed(self, store: DataStore, exc: Exception) -> None:
        """A fill that raised: the event is left out (what the fill added before it
        raised stays, as for a module error in a path), counted per kind, and the first
        of each kind is logged with its traceback."""
        cause = type(exc).__name__
        uid = store.meta.uid
        first = (self.qc_task.name, cause) not in self.task_failures.groups
        tb = exc.__traceback__
        user_tb = "".join(traceback.format_exception(type(exc), exc, tb.tb_next if tb else None))
        self.task_failures.add(self.qc_task.name, cause, str(exc)[:500], uid, user_tb[-4000:])
        self.task_errors += 1
        if first:
            log.error(
                "%s: QC task %r raised %s on event uid=%d: the event is left out, and "
                "every later %s is counted, not logged\n%s",
                self.id, self.qc_task.name, cause, uid, cause, user_tb.rstrip(),
            )  # fmt: skip

    def post_run(self) -> None:
        self.qc_task.end_run(RunMeta(0, self.run_number))  # its merger must not wait
        for group in self.task_failures.groups.values():
            n = len(group.uids)
            shown = ", ".join(str(u) for u in group.uids[:SHOWN_UIDS])
            more = ", ..." if n > SHOWN_UIDS else ""
            log.error(
                "%s: QC task %r failed on %d of %d events: %s on %d (uids %s%s): %s",
                self.id, group.module, self.task_errors, self.events_in, group.cause,
                group.attempts, shown, more, group.text,
            )  # fmt: skip
        if self.taken_before:
            # what the dead process filled and had not published died with it, and the
            # merger cannot tell those events from the ones it has: the objects are short
            raise IncompleteStreamError(
                f"qc-producer {self.id!r}: restarted after its process died; of the "
                f"{self.taken_before} events that process took, those it had not published "
                f"are missing from the QC objects ({self.events_in} events taken in all)"
            )

    def reset_task(self) -> None:
        self.qc_task.terminate()

    def metrics(self) -> dict[str, Any]:
        out = super().metrics()
        task = getattr(self, "qc_task", None)
        if task is not None:
            out["qc"] = {**task.statistics(), "events_in": self.events_in,
                         "bad_events": self.bad_events, "task_errors": self.task_errors,
                         "task_error_kinds": {g.cause: g.attempts for g in
                                              self.task_failures.groups.values()}}  # fmt: skip
        return out
