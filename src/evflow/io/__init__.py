"""Event input and output: record files, ROOT through uproot, toy generators.

Sources (first module of a path): ``RecordInput``, ``RootInput``, ``ToyGenerator``.
Writers (output modules, ``Writer`` subclasses): ``RecordOutput``, ``RootOutput``.
``RecordWriter``/``RecordReader`` handle record files without a path.
"""

from evflow.io.generators import BusyWork, ToyGenerator
from evflow.io.records import (
    Record,
    RecordInput,
    RecordOutput,
    RecordReader,
    RecordWriter,
    TornTail,
)
from evflow.io.root import RootInput, RootOutput
from evflow.processing.writer import Writer

__all__ = [
    "BusyWork",
    "Record",
    "RecordInput",
    "RecordOutput",
    "RecordReader",
    "RecordWriter",
    "RootInput",
    "RootOutput",
    "TornTail",
    "ToyGenerator",
    "Writer",
]
