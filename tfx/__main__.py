"""`python -m tfx` runs the `tfx` command."""

import sys

from tfx.cli import command

sys.exit(command())
