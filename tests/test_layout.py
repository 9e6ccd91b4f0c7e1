"""The house rules the code's layout keeps: the core is written against its seams and reaches implementations only
through the registry; every registered implementation is a complete subclass of its seam."""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

from ppharness import registry
from ppharness.seams import Provider, Transport

ROOT = Path(__file__).resolve().parent.parent
IMPLEMENTATIONS = ("transports", "backends")


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import ``path`` makes when it runs, function-level imports included (those under
    ``if TYPE_CHECKING:`` are for the type checker only)."""
    tree = ast.parse(path.read_text(), str(path))
    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
        for stmt in node.body
        for inner in ast.walk(stmt)
    }
    found = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def test_the_core_never_imports_an_implementation_by_name() -> None:
    offenders = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in sorted((ROOT / "ppharness").rglob("*.py"))
        for line, module in _imports(path)
        if module.split(".")[0] in IMPLEMENTATIONS
    ]
    assert not offenders, "the core reaches transports and backends only through ppharness.registry:\n" + "\n".join(
        offenders
    )


def test_implementations_depend_on_the_core_not_on_each_other() -> None:
    """A transport never imports a backend and the other way round (both import the seams from the core)."""
    offenders = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for package, other in (("transports", "backends"), ("backends", "transports"))
        for path in sorted((ROOT / package).rglob("*.py"))
        for line, module in _imports(path)
        if module.split(".")[0] == other
    ]
    assert not offenders, "\n".join(offenders)


@pytest.mark.parametrize("kind", sorted(registry.TRANSPORTS))
def test_every_registered_transport_is_a_complete_transport(kind: str) -> None:
    cls = registry.transport_class(kind)
    assert issubclass(cls, Transport) and not inspect.isabstract(cls), f"{kind}: {cls} leaves abstract methods"
    assert cls.kind == kind, f"registry kind {kind!r} names a class whose kind is {cls.kind!r}"


@pytest.mark.parametrize("kind", sorted(registry.PROVIDERS))
def test_every_registered_provider_is_a_complete_provider(kind: str) -> None:
    cls = registry.provider_class(kind)
    assert issubclass(cls, Provider) and not inspect.isabstract(cls), f"{kind}: {cls} leaves abstract methods"
    assert cls.kind == kind, f"registry kind {kind!r} names a class whose kind is {cls.kind!r}"


@pytest.mark.parametrize("name", sorted(registry.TOOLS))
def test_every_registered_tool_is_callable(name: str) -> None:
    assert callable(registry.tool(name))


def test_an_unknown_kind_names_the_known_ones() -> None:
    with pytest.raises(registry.HarnessError, match="unknown transport kind 'carrier-pigeon': expected one of"):
        registry.transport_class("carrier-pigeon")


def test_the_orchestrator_and_cli_start_without_loading_the_model_code() -> None:
    """Starting a command (or the orchestrator) costs no tinygrad import: only the nodes and the oracle load it."""
    code = (
        "import sys, ppharness.cli, ppharness.run.seed.orchestrator, ppharness.scenario.schema; "
        "print(sorted(m for m in ('tinygrad', 'gguf') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]", f"importing the CLI and the orchestrator loaded {out}"


def test_backends_own_their_settings() -> None:
    """Every kind's scenario settings live with the kind (``backends/``, ``transports/``) and the core defines none:
    its provider and transport sections are built from the registry. The registry finds them without loading the
    kinds themselves, so reading a scenario loads no SDK or binding."""
    declared = [(kind, registry.provider_settings_type(kind), "backends") for kind in registry.PROVIDERS]
    declared += [(kind, registry.transport_settings_type(kind), "transports") for kind in registry.TRANSPORTS]
    misplaced = [
        f"{kind}: {settings.__qualname__} is defined in {settings.__module__}"
        for kind, settings, home in declared
        if settings is not None and settings.__module__.split(".")[0] != home
    ]
    assert not misplaced, "\n".join(misplaced)
    bases = {"ProviderSettings", "TransportSettings"}
    names = {f"{kind}settings" for kind in (*registry.PROVIDERS, *registry.TRANSPORTS)}
    offenders = [
        f"{path.relative_to(ROOT)}:{node.lineno} defines {node.name}"
        for path in sorted((ROOT / "ppharness").rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.ClassDef)
        and (node.name.lower() in names or any(ast.unparse(b).split(".")[-1] in bases for b in node.bases))
    ]
    assert not offenders, "an implementation's settings belong to the implementation:\n" + "\n".join(offenders)
    code = (
        "import sys, ppharness.scenario.schema; "
        "print(sorted(m for m in ('docker', 'httpx', 'zmq', 'iroh') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]", f"importing the scenario format loaded {out}"


PRODUCT = ("ppharness", "transports", "backends")
MAX_LINES = 600  # a product file over this holds more than one concern: split it
MAX_LOCAL_IMPORTS = 40


def _product_files() -> list[Path]:
    return sorted(p for package in PRODUCT for p in (ROOT / package).rglob("*.py"))


def _room(module: str) -> str | None:
    """The room (``ppharness.<subpackage>``, or ``transports``/``backends``) a module of the project lives in."""
    parts = module.split(".")
    if parts[0] == "ppharness":
        return ".".join(parts[:2])
    return parts[0] if parts[0] in IMPLEMENTATIONS else None


def _module_of(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def _top_level_imports(path: Path) -> list[str]:
    """The project modules ``path`` imports when it is imported (module level, outside ``if TYPE_CHECKING:``)."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append(node.module)
    return [m for m in found if _room(m) is not None]


def _local_imports(path: Path) -> list[tuple[int, str, bool]]:
    """(line, module, explained) of each import of a project module made inside a function; ``explained``: a comment
    on its line or the line above says why it is not at module level."""
    text = path.read_text()
    lines = text.splitlines()
    tree = ast.parse(text, str(path))
    found = []
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for node in ast.walk(fn):
            module = None
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                module = node.module
            elif isinstance(node, ast.Import):
                module = node.names[0].name
            if module is None or _room(module) is None:
                continue
            explained = _commented(lines, node.lineno)
            found.append((node.lineno, module, explained))
    return sorted(set(found))


def _commented(lines: list[str], lineno: int) -> bool:
    """Whether a comment says why the import on ``lineno`` (1-based) is made here: on its own line, or on the line
    above the run of imports (blank lines allowed) it belongs to."""
    if "#" in lines[lineno - 1]:
        return True
    for line in reversed(lines[: lineno - 1]):
        text = line.strip()
        if text.startswith("#"):
            return True
        if text and not text.startswith(("from ", "import ")):
            return False
    return False


def test_no_circle_between_rooms_at_module_level() -> None:
    """Importing a room never imports, through module-level imports, a room that imports it back."""
    edges: dict[str, set[str]] = {}
    for path in _product_files():
        src = _room(_module_of(path))
        assert src is not None
        for module in _top_level_imports(path):
            dst = _room(module)
            if dst is not None and dst != src:
                edges.setdefault(src, set()).add(dst)
    circles = []
    for start in sorted(edges):
        stack, seen = [(start, [start])], set()
        while stack:
            room, way = stack.pop()
            for nxt in sorted(edges.get(room, ())):
                if nxt == start:
                    circles.append(" -> ".join(way + [start]))
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, way + [nxt]))
    assert not circles, "rooms that import each other at module level:\n" + "\n".join(sorted(set(circles)))


def test_no_product_file_holds_more_than_one_room() -> None:
    long = [
        f"{p.relative_to(ROOT)}: {n} lines"
        for p in _product_files()
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    ]
    assert not long, f"product files over {MAX_LINES} lines (split them by concern):\n" + "\n".join(long)


def test_function_local_imports_are_few_and_each_says_why() -> None:
    """An import of the project's own modules inside a function is for a heavy optional dependency or a real cycle,
    and a comment says which; there are at most ``MAX_LOCAL_IMPORTS`` of them."""
    found = [(p, line, m, why) for p in _product_files() for line, m, why in _local_imports(p)]
    silent = [f"{p.relative_to(ROOT)}:{line} imports {m}" for p, line, m, why in found if not why]
    assert not silent, "function-local imports with no comment saying why:\n" + "\n".join(silent)
    assert len(found) <= MAX_LOCAL_IMPORTS, (
        f"{len(found)} function-local imports of the project's modules (at most {MAX_LOCAL_IMPORTS}):\n"
        + "\n".join(f"{p.relative_to(ROOT)}:{line} {m}" for p, line, m, _ in found)
    )
