"""``python -m hopperkern.tune``: see :mod:`hopperkern.tune`."""

import sys

from .cli import main

sys.exit(main())
