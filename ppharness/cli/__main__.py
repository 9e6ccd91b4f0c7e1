"""``python -m ppharness.cli``: the ``ppharness`` command."""

from ppharness.cli import main

main()
