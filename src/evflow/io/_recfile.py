"""Record files on disk: ``RecordWriter`` and ``RecordReader`` for raw records.

A record is (uid, flags, payload bytes); ``evflow.io.records`` puts events into them.
The format is described in ``evflow.io._recformat``, writing in ``_recwriter`` and
reading (with recovery of torn and damaged files) in ``_recreader``.
"""

from __future__ import annotations

from evflow.io._recreader import OnCorrupt, Record, RecordReader, TornTail
from evflow.io._recwriter import RecordWriter

__all__ = ["OnCorrupt", "Record", "RecordReader", "RecordWriter", "TornTail"]
