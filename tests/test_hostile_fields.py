"""The typed header accessors handlers use on untrusted messages (wire/messages.py)."""

from __future__ import annotations

import math

import pytest

from evflow.errors import ProtocolError
from evflow.processing.parallel.common import run_of
from evflow.wire.messages import (
    BadMessageCounter,
    field_bytes,
    field_float,
    field_int,
    field_list,
    field_str,
    refuse,
)


@pytest.mark.parametrize("value", [math.inf, math.nan, 1.0, True, "12", None, -1, 2**63, [1]])
def test_field_int_refuses_what_is_not_an_int_in_range(value: object) -> None:
    with pytest.raises(ProtocolError, match="'pid'") as info:
        field_int({"pid": value}, "pid")
    assert info.value.kind == "bad-field"  # type: ignore[attr-defined]


def test_field_accessors_return_good_values() -> None:
    header = {"n": 7, "t": 0.25, "s": "worker-1", "u": b"\0" * 16, "l": [1, 2]}
    assert field_int(header, "n", 0, 10) == 7
    assert field_float(header, "t") == 0.25
    assert field_str(header, "s", 32) == "worker-1"
    assert field_bytes(header, "u", 8) == b"\0" * 16
    assert field_list(header, "l") == [1, 2]


@pytest.mark.parametrize(
    ("call", "header"),
    [
        (lambda h: field_float(h, "t"), {"t": math.nan}),
        (lambda h: field_float(h, "t"), {"t": math.inf}),
        (lambda h: field_float(h, "t", 0, 1), {"t": 2}),
        (lambda h: field_str(h, "s", 4), {"s": "too long"}),
        (lambda h: field_str(h, "s"), {"s": b"bytes"}),
        (lambda h: field_bytes(h, "u", 8), {"u": b"\0" * 7}),
        (lambda h: field_bytes(h, "u", 8), {"u": "text"}),
        (lambda h: field_list(h, "l", 2), {"l": [1, 2, 3]}),
        (lambda h: field_list(h, "l"), {}),
    ],
)
def test_field_accessors_refuse_bad_values(call: object, header: dict[str, object]) -> None:
    with pytest.raises(ProtocolError):
        call(header)  # type: ignore[operator]


def test_a_refusal_is_counted_under_its_kind_and_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    bad = BadMessageCounter("test")
    for _ in range(3):
        bad.record_error(refuse("unknown-peer", "CONFIRM from a stranger"))
    assert bad.counts == {"unknown-peer": 3}
    assert sum("unknown-peer" in r.message for r in caplog.records) == 1


@pytest.mark.parametrize("value", [None, [], [1], [1, 2, 3], ["a", 1], [1.5, 2], {"a": 1}, "x"])
def test_run_of_refuses_what_is_not_a_run(value: object) -> None:
    assert run_of(value) is None


def test_run_of_reads_a_run() -> None:
    run = run_of([3, 7])
    assert run is not None and (run.experiment, run.run) == (3, 7)
