"""``python -m swarmd``: the same entry point as the ``swarmd`` console script."""

import sys

from swarmd.cli import main

sys.exit(main())
