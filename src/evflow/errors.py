"""Every exception evflow raises, grouped by cause.

Messages name the object, the bad value, what was expected and, where there is one,
the likely fix. Catch ``EvflowError`` to catch them all.
"""

from __future__ import annotations

import signal
from types import FrameType


class EvflowError(Exception):
    """Base of every evflow error."""


# --- configuration: the user asked for something that cannot work -------------------
class ConfigurationError(EvflowError, ValueError):
    """A bad steering file, parameter, channel config, topology or command line."""


class ParameterError(ConfigurationError):
    """A module parameter that does not exist or has the wrong type."""


class SteeringError(ConfigurationError):
    """A steering file that does not compile or raises while it builds the path."""


# --- input/output --------------------------------------------------------------------
class InputError(EvflowError):
    """An input file that is missing, unreadable or not what it claims to be."""


class OutputError(EvflowError):
    """An output that cannot be opened or written."""


class CorruptRecordError(InputError):
    """A record file whose header or a record fails its checks."""


class CheckpointError(InputError):
    """A checkpoint file that is corrupt, of an unknown version or of another run."""


class NotFoundError(InputError, LookupError):
    """Something asked for by name or id that is not there (a QC object path, a version)."""


class StorageFullError(OutputError):
    """An output whose disk is full; writing may succeed again once space is freed."""


# --- processing ----------------------------------------------------------------------
class ModuleError(EvflowError):
    """User code raised inside a module hook; carries the module, hook and event uid."""

    def __init__(
        self, module: str, hook: str, uid: int | None, cause: BaseException, tb: str = ""
    ) -> None:
        where = f"module {module!r} raised in {hook}()"
        if uid is not None:
            where += f" on event uid={uid}"
        super().__init__(f"{where}: {type(cause).__name__}: {cause}")
        self.module = module
        self.hook = hook
        self.uid = uid
        self.cause = cause
        self.traceback_text = tb


# --- wire and transport --------------------------------------------------------------
class ProtocolError(EvflowError):
    """A message that violates the wire protocol (bad type, header, frames or version)."""


class CodecError(ProtocolError):
    """An event that cannot be encoded, or frames that do not decode to an event."""


class PeerLostError(EvflowError):
    """A peer process died or stopped answering."""


class IncompleteStreamError(PeerLostError):
    """A stream that ended with a count that does not hold (messages missing, an END that
    never came or was never acknowledged). Final: a device that ends with it is not
    restarted (running it again cannot bring the messages back)."""


class ClosedError(EvflowError):
    """An operation on something we closed ourselves."""


class TimeoutError_(EvflowError, TimeoutError):
    """A deadline passed."""


# --- runtime -------------------------------------------------------------------------
class StateTransitionError(EvflowError):
    """A device state transition that the state machine does not allow."""


class InternalError(EvflowError):
    """A bug in evflow itself; please report it with the message."""


def caused_by_interrupt(exc: BaseException) -> bool:
    """True if ``exc`` came from a Ctrl-C: one reached :func:`count_interrupts`' handler,
    or a KeyboardInterrupt is somewhere in the chain of causes of ``exc``.

    A Ctrl-C that lands while a C extension initialises surfaces as an ImportError
    "from" the KeyboardInterrupt, or (numpy importing datetime through a capsule) as an
    ImportError that lost the KeyboardInterrupt altogether; the command must still exit
    130, not report an error.
    """
    if _interrupts_seen:
        return True
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, KeyboardInterrupt):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


_interrupts_seen = 0


def _counting_int_handler(signum: int, frame: FrameType | None) -> None:
    global _interrupts_seen
    _interrupts_seen += 1
    raise KeyboardInterrupt


def count_interrupts() -> None:
    """Count SIGINTs from here on while keeping Python's behaviour (KeyboardInterrupt).

    Left alone when SIGINT is ignored (a job started in the background by a shell).
    """
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _counting_int_handler)


# --- online quality control ----------------------------------------------------------
class QcError(EvflowError):
    """A QC object that cannot be merged or published."""


class IncompatibleObjectsError(QcError):
    """Two QC objects of one name that cannot be merged (type, binning, columns)."""


class NotMergeableError(QcError):
    """A QC object of a kind that has no merge (``+=``) at all."""
