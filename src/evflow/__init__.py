"""evflow: reliable parallel event processing for particle physics over ZeroMQ."""

from evflow.errors import EvflowError
from evflow.processing import DataStore, EventMeta, Module, Param, Path, RunMeta, Source
from evflow.processing.api import process
from evflow.processing.options import ProcessOptions
from evflow.processing.summary import RunSummary

__version__ = "0.1.0"

__all__ = [
    "DataStore",
    "EventMeta",
    "EvflowError",
    "Module",
    "Param",
    "Path",
    "ProcessOptions",
    "RunMeta",
    "RunSummary",
    "Source",
    "__version__",
    "process",
]
