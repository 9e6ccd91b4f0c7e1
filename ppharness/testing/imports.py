"""The import graph of a Python tree read from its source: every import a module makes, at module level, inside a
function or under ``if TYPE_CHECKING:``, resolved to the modules of the tree it names. ``tests/test_architecture.py``
holds the house's floors against it; ``python -m ppharness.testing.imports`` prints its circles and upward arrows."""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Arrow:
    """``source`` imports ``target`` at ``line``; ``kind`` is ``module``, ``function`` or ``typing``."""

    source: str
    target: str
    line: int
    kind: str


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _typing_only(tree: ast.AST) -> set[int]:
    return {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
        for stmt in node.body
        for inner in ast.walk(stmt)
    }


def _in_function(tree: ast.AST) -> set[int]:
    return {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        for stmt in node.body
        for inner in ast.walk(stmt)
    }


def _resolve(name: str, modules: set[str]) -> str | None:
    """The tree's module that ``name`` (a module or a name inside one) means: the longest prefix that is a module."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def graph(root: Path, packages: Iterable[str]) -> tuple[set[str], list[Arrow]]:
    """The modules under ``root/<package>`` for each package and every arrow between them."""
    files = {module_name(root, path): path for package in packages for path in sorted((root / package).rglob("*.py"))}
    modules = set(files)
    arrows: list[Arrow] = []
    for source, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        typing, inner = _typing_only(tree), _in_function(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                base = node.module
                if node.level:
                    package = source if path.name == "__init__.py" else source.rpartition(".")[0]
                    for _ in range(node.level - 1):
                        package = package.rpartition(".")[0]
                    base = f"{package}.{node.module}"
                names = [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            kind = "typing" if id(node) in typing else "function" if id(node) in inner else "module"
            for name in names:
                target = _resolve(name, modules)
                if target is not None and target != source:
                    arrows.append(Arrow(source, target, node.lineno, kind))
    return modules, arrows


def circles(modules: set[str], arrows: list[Arrow]) -> list[list[str]]:
    """The strongly connected sets of more than one module (Tarjan), each sorted, largest first."""
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for arrow in arrows:
        edges[arrow.source].add(arrow.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))

    def visit(node: str) -> None:
        nonlocal counter
        index[node] = low[node] = counter
        counter += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in edges[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(modules):
        if module not in index:
            visit(module)
    return sorted(found, key=lambda c: (-len(c), c))


def main(argv: list[str]) -> int:
    root = Path(argv[0]) if argv else Path.cwd()
    modules, arrows = graph(root, ["ppharness"])
    for circle in circles(modules, arrows):
        print(f"circle of {len(circle)}: {', '.join(circle)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
