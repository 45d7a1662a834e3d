"""``python -m evflow``: the ``evflow`` command."""

import sys

try:
    from evflow.cli import main
except KeyboardInterrupt:  # Ctrl-C during the imports: one line, as everywhere else
    sys.stderr.write("evflow: interrupted\n")
    sys.exit(130)

sys.exit(main())
