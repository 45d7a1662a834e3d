"""A Ctrl-C while the ``evflow`` command imports the package: one line, exit 130.

``python -m evflow`` and the ``evflow`` script import the package before any of the
command's code runs, so ``evflow/__init__.py`` asks here what to do with a
KeyboardInterrupt that arrives during its imports. In any other program importing
evflow the interrupt goes on as usual.
"""

from __future__ import annotations

import os
import signal
import sys

#: the module names ``python -m`` runs as the command
COMMAND_MODULES = ("evflow", "evflow.cli")


def is_evflow_command() -> bool:
    """True when this interpreter runs the ``evflow`` command (script or ``-m``)."""
    argv = list(getattr(sys, "orig_argv", ()))
    if "-m" in argv[1:]:
        i = argv.index("-m", 1)
        return i + 1 < len(argv) and argv[i + 1] in COMMAND_MODULES
    return os.path.basename(sys.argv[0] if sys.argv else "") == "evflow"


def interrupted_during_import() -> None:
    """Exit 130 with one line if this is the ``evflow`` command; else return."""
    if is_evflow_command():
        # a second Ctrl-C while the interpreter exits would end it by the signal (-2)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        sys.stderr.write("evflow: interrupted\n")
        sys.stderr.flush()
        raise SystemExit(130)
