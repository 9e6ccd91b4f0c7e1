"""Print the project's dependencies (``[project] dependencies`` of pyproject.toml), one requirement a line.

Usage: ``python requirements.py pyproject.toml [EXTRA...]`` (also prints the named optional-dependency groups).
Works on Python 3.10 (no tomllib) with a reader for the simple list syntax pyproject.toml uses.
"""

from __future__ import annotations

import re
import sys


def _lists(text: str) -> dict[str, list[str]]:
    """``key = [ "a", "b" ]`` arrays of the file, by ``section.key`` (trailing comments without quotes dropped)."""
    text = re.sub(r"\s+#[^\"'\n]*$", "", text, flags=re.M)
    out: dict[str, list[str]] = {}
    section = ""
    for m in re.finditer(r"^\s*\[([^\]\n]+)\]\s*$|^\s*([A-Za-z0-9_.-]+)\s*=\s*\[(.*?)\]\s*$", text, re.M | re.S):
        if m[1] is not None:
            section = m[1].strip()
        else:
            out[f"{section}.{m[2]}"] = [a or b for a, b in re.findall(r"\"([^\"]+)\"|'([^']+)'", m[3])]
    return out


def requirements(pyproject: str, extras: list[str]) -> list[str]:
    """The dependencies and the requested extras' requirements, in file order."""
    with open(pyproject, encoding="utf-8") as f:
        text = f.read()
    try:
        import tomllib
    except ImportError:
        lists = _lists(text)
        deps = list(lists.get("project.dependencies", []))
        for extra in extras:
            deps += lists.get(f"project.optional-dependencies.{extra}", [])
        return deps
    project = tomllib.loads(text)["project"]
    deps = list(project.get("dependencies", []))
    for extra in extras:
        deps += project.get("optional-dependencies", {}).get(extra, [])
    return deps


if __name__ == "__main__":
    print("\n".join(requirements(sys.argv[1], sys.argv[2:])))
