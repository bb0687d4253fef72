import sys

from swarmd.cli import main

sys.exit(main())
