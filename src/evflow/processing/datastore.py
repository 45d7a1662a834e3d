"""The event model under its processing name: :mod:`evflow.event` holds it, below the
wire codec that encodes it; this name stays for user code and for pickles written
before the move."""

from __future__ import annotations

from evflow.event import (
    FLAG_DROPPED,
    FLAG_QUARANTINED,
    QUARANTINE_REASON,
    DataStore,
    EventMeta,
    RunMeta,
)

__all__ = [
    "FLAG_DROPPED",
    "FLAG_QUARANTINED",
    "QUARANTINE_REASON",
    "DataStore",
    "EventMeta",
    "RunMeta",
]
