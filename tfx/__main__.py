"""`python -m tfx` runs the `tfx` command."""

import sys

from tfx.cli import main

sys.exit(main())
