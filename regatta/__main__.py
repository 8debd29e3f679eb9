"""``python -m regatta ...`` is the ``regatta`` command (regatta/cli.py)."""
import sys

from .cli import main

sys.exit(main())
