import sys

from evflow.cli import main

sys.exit(main())
