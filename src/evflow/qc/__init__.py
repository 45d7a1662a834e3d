"""Online quality control: QC objects, producers (``QcTask``), mergers and their layers.

See ``docs/qc.md``. The merger device is ``evflow.qc.merger.QcMerger`` (built-in
``qc-merger``), the standalone producer ``evflow.qc.producer_device.QcProducer``
(``qc-producer``), the repository device ``evflow.qc.repository_device.QcRepositoryDevice``
(``qc-repository``: checks and stores the mergers' publications, see
``docs/qc_repository.md``).
"""

from __future__ import annotations

from evflow.qc.objects import decode_object, encode_object, merge
from evflow.qc.producer import QcTask
from evflow.qc.publication import PublishedObject, decode_publication
from evflow.qc.recordbatch import ConcatArray, RecordBatch

__all__ = [
    "ConcatArray",
    "PublishedObject",
    "QcTask",
    "RecordBatch",
    "decode_object",
    "decode_publication",
    "encode_object",
    "merge",
]
