"""``python -m sluice.cli``: the ``sluice`` command."""

from sluice.cli import main

main()
