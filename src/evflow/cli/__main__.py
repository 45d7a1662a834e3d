"""``python -m evflow``: the ``evflow`` command."""

import signal
import sys

try:
    from evflow.cli import run
except KeyboardInterrupt:  # Ctrl-C during the imports: one line, as everywhere else
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second one must not end it by signal
    sys.stderr.write("evflow: interrupted\n")
    sys.exit(130)

run()
