"""`python -m tfx` runs the `tfx` command."""

from tfx.cli import command

command()  # exits with the command's status
