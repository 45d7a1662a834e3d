"""The toy generator and the busy-work module."""

from __future__ import annotations

import time

import numpy as np
import pytest

from evflow.errors import ParameterError
from evflow.event import DataStore
from evflow.io.generators import BusyWork, ToyGenerator, burn_cpu


def _key(store: DataStore) -> tuple[object, ...]:
    return (
        store.meta.as_dict(),
        store["payload"].tobytes(),
        store["position"],
        store["value"],
        store["tag"],
    )


@pytest.mark.parametrize("start", [0, 1, 17, 99, 100, 150])
def test_events_from_start_k_are_the_tail_of_events_from_zero(start: int) -> None:
    gen = ToyGenerator(n_events=100, seed=7, payload_bytes=300, experiment=2, run=5)
    full = [_key(s) for s in gen.events(0)]
    assert [_key(s) for s in gen.events(start)] == full[start:]
    # a second generator with the same seed (e.g. in a restarted process) agrees
    again = ToyGenerator(n_events=100, seed=7, payload_bytes=300, experiment=2, run=5)
    assert [_key(s) for s in again.events(start)] == full[start:]


def test_events_carry_meta_payload_and_scalars() -> None:
    gen = ToyGenerator(n_events=3, payload_bytes=1024, experiment=4, run=8)
    assert gen.total() == 3
    stores = list(gen.events())
    assert [s.meta.uid for s in stores] == [0, 1, 2]
    for k, s in enumerate(stores):
        assert (s.meta.experiment, s.meta.run, s.meta.event) == (4, 8, k)
        assert s["payload"].dtype == np.uint8 and s["payload"].nbytes == 1024
        assert not s["payload"].flags.writeable  # shared block: nobody may change it
        assert 0.0 <= s["value"] < 1.0 and 0 <= s["tag"] < 16 and s["position"] == k
    assert len({s["payload"].tobytes() for s in stores}) == 3  # events differ


def test_seeds_give_different_events_and_empty_payloads_work() -> None:
    a = ToyGenerator(n_events=5, seed=1).make_event(3)
    b = ToyGenerator(n_events=5, seed=2).make_event(3)
    assert a["payload"].tobytes() != b["payload"].tobytes() and a["value"] != b["value"]
    assert ToyGenerator(n_events=1, payload_bytes=0).make_event(0)["payload"].nbytes == 0


def test_event_creation_is_cheap() -> None:
    gen = ToyGenerator(n_events=20_000, payload_bytes=1024)
    cpu0 = time.thread_time()  # CPU time: what the machine's load does not stretch
    n = sum(1 for _ in gen.events())
    per_event_us = (time.thread_time() - cpu0) / n * 1e6
    assert n == 20_000
    assert per_event_us < 30, f"{per_event_us:.1f} µs of CPU per 1 kB event"  # ~2 µs measured


def test_busy_work_burns_cpu_time_not_wall_time() -> None:
    module = BusyWork(work_ms=20.0)
    assert module.parallel is True and ToyGenerator.parallel is False
    store = ToyGenerator(n_events=1).make_event(0)
    cpu0 = time.thread_time()
    assert module.event(store) is None
    assert time.thread_time() - cpu0 >= 0.020
    cpu0 = time.thread_time()
    burn_cpu(0.0)
    assert time.thread_time() - cpu0 < 0.005


def test_generator_work_ms_burns_cpu_in_the_source() -> None:
    gen = ToyGenerator(n_events=5, payload_bytes=10, work_ms=4.0)
    cpu0 = time.thread_time()
    assert len(list(gen.events())) == 5
    assert time.thread_time() - cpu0 >= 0.020


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"n_events": -1}, "'n_events' must be >= 0"),
        ({"payload_bytes": -5}, "'payload_bytes' must be >= 0"),
        ({"work_ms": -1.0}, "'work_ms' must be >= 0"),
        ({"seed": "x"}, "'seed' expects int"),
    ],
)
def test_bad_generator_parameters_are_refused(params: dict[str, object], message: str) -> None:
    with pytest.raises(ParameterError, match=message):
        ToyGenerator(**params)
    with pytest.raises(ParameterError, match="'work_ms' must be >= 0"):
        BusyWork(work_ms=-2)
    with pytest.raises(ParameterError, match="start must be >= 0"):
        list(ToyGenerator(n_events=2).events(-1))


def test_evflow_io_exports_its_public_classes() -> None:
    import evflow.io

    for name in evflow.io.__all__:
        assert hasattr(evflow.io, name), name
    assert issubclass(evflow.io.RecordOutput, evflow.io.Writer)
    assert issubclass(evflow.io.RootOutput, evflow.io.Writer)
    for source in (evflow.io.RecordInput, evflow.io.RootInput, evflow.io.ToyGenerator):
        assert issubclass(source, evflow.Source)
