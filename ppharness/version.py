"""Which ppharness this is: package versions and, from a checkout, the git commit. ``--version`` prints it, a
benchmark's provenance and a device's ``measured`` carry it. Light: no model code, no tinygrad import."""

from __future__ import annotations

import importlib.metadata
import subprocess
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the checkout (or site-packages) that holds this package


def installed(package: str) -> str:
    """``package``'s version; ppharness run from a source tree it was not installed from (a machine that puts the tree
    on ``PYTHONPATH``): its ``pyproject.toml``'s; "unknown" when neither says."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        pass
    if package == "ppharness":
        try:
            project = tomllib.loads((ROOT / "pyproject.toml").read_text()).get("project", {})
        except (OSError, tomllib.TOMLDecodeError):
            project = {}
        if isinstance(project.get("version"), str):
            return str(project["version"])
    return "unknown"


def checkout_commit() -> str:
    """The commit of the git checkout this package runs from (``-dirty`` with uncommitted changes), or "" when it is
    installed elsewhere or git is not at hand."""
    if not (ROOT / ".git").exists():
        return ""
    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), "describe", "--always", "--dirty", "--abbrev=12"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip()


def version_text(prog: str) -> str:
    """``--version``'s line: this package's version, tinygrad's and, from a checkout, the git commit."""
    commit = checkout_commit()
    where = f", commit {commit}" if commit else ""
    return f"{prog} {installed('ppharness')} (tinygrad {installed('tinygrad')}{where})"
