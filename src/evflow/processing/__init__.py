"""Modules, paths, the event store and the processors that run them."""

from evflow.event import DataStore, EventMeta, RunMeta
from evflow.processing.module import Module, Param, Source
from evflow.processing.path import Path

__all__ = ["DataStore", "EventMeta", "Module", "Param", "Path", "RunMeta", "Source"]
