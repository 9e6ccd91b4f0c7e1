"""``python -m ppharness.cli.smoke`` = ``pp-smoke-run`` (for environments where the console script is not on PATH)."""

from ppharness.cli import smoke_run

if __name__ == "__main__":
    smoke_run()
