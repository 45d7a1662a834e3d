"""The path of the current parallel run, kept where forked processes find it.

The parent sets it before the zygote forks; every role forked later reads it (the
zygote and its children inherit it, copy-on-write), so the path is never sent over
a socket.
"""

from __future__ import annotations

from evflow.errors import InternalError
from evflow.processing.parallel.split import SplitPath

_current: SplitPath | None = None


def set_current(split: SplitPath | None) -> None:
    global _current
    _current = split


def current() -> SplitPath:
    if _current is None:
        raise InternalError("no parallel path set in this process (fork before set_current?)")
    return _current
