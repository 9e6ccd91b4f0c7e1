"""``pp-node``'s entry point: which node this process is, read from its environment.

- ``--version``: the version, and exit 0;
- ``PP_STANDBY``: a standby spare, until an Assign makes it a stage (``ppharness.run.node.node.stand_by``);
- ``PP_GROUP``: co-located stages served by this one process (``ppharness.run.node.colocated``);
- else one stage (or expert node) from the node contract (``ppharness.run.node.node``).
"""

from __future__ import annotations

import os
import sys

from ppharness.errors import HarnessError
from ppharness.run.node.colocated import serve_group
from ppharness.run.node.env import GROUP_ENV, node_log, read_env
from ppharness.run.node.node import serve, stand_by
from ppharness.version import version_text


def main() -> None:
    if sys.argv[1:] == ["--version"]:
        print(version_text("pp-node"))
        sys.exit(0)
    if os.environ.get("PP_STANDBY"):
        sys.exit(stand_by(dict(os.environ)))
    if os.environ.get(GROUP_ENV):
        sys.exit(serve_group(dict(os.environ)))
    try:
        plan, env = read_env(dict(os.environ))
    except HarnessError as exc:
        node_log(os.environ.get("STAGE", "?"), f"failed: {exc}")
        sys.exit(1)
    sys.exit(serve(plan, env))


if __name__ == "__main__":
    main()
