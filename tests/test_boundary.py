"""The import rules, checked on every module's imports (top level, lazy ones inside functions, and
``if TYPE_CHECKING`` ones): runtime/ imports no UI package (typer, click, rich, textual); layers
import only downwards (core <- engine models <- decoding <- model resolution <- features <- front
ends); no two files import each other, directly or around a circle; the packages form a DAG."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import runtime

UI = ("typer", "click", "rich", "textual")


def test_runtime_pulls_in_no_ui_packages():
    root = Path(runtime.__file__).parent
    modules = ["runtime"] + [
        f"runtime.{m.name}" for m in pkgutil.walk_packages([str(root)]) if not m.name.startswith("_")
    ]
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}:\n"
        "    importlib.import_module(m)\n"
        f"bad = [m for m in sys.modules if m.split('.')[0] in {UI!r}]\n"
        "print(','.join(sorted(bad)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root.parent, check=True)
    assert out.stdout.strip() == "", f"runtime imported UI packages: {out.stdout}"
    assert len(modules) > 10


def test_runtime_sources_never_mention_ui_imports():
    root = Path(runtime.__file__).parent
    for path in root.rglob("*.py"):
        for line in path.read_text().splitlines():
            s = line.strip()
            for pkg in UI:
                assert not s.startswith((f"import {pkg}", f"from {pkg}")), f"{path}: {s}"


# -- the import graph between layers ---------------------------------------------------------------
# From the ground up:
#   core           runtime/config.py, errors.py, textio.py: frozen configs, errors, text decoding rules
#   engine-models  runtime/engine/models/: what the decode loop runs (target adapter, lean target,
#                  drafter and its files, KV caches, projections, native kernels, corpus table, device)
#   engine         runtime/engine/*.py: decoding (the loop, planner, proposers, trees, prompt cache)
#   models         runtime/models/: finding, fetching and checking model folders (hub, presets,
#                  store, download, configs, quantized folders and schemes)
#   features       pipeline, session, backend, bench, quantize, train, client, doctor, fim
#   api            runtime/__init__.py: the re-exports front ends use
#   tui, cli       the two front ends (the CLI may open the TUI)
# A module imports modules of its own layer or of layers below it, never above.
ROOT = Path(runtime.__file__).parent.parent
CORE = ("config", "errors", "textio")
FEATURES = ("bench", "quantize", "client", "train", "pipeline", "loading", "doctor", "session", "backend", "fim")
LAYERS = ("core", "engine-models", "engine", "models", "features", "api", "tui", "cli")


def layer(module: str) -> str | None:
    """The layer of a module of this project (None: a third-party or standard module)."""
    parts = module.split(".")
    if parts[0] == "tui":
        return "tui"
    if parts[0] == "dflash_cli":
        return "cli"
    if parts[0] != "runtime":
        return None
    if len(parts) == 1:
        return "api"
    if parts[1] in CORE:
        return "core"
    if parts[1] == "engine":
        return "engine-models" if parts[2:3] == ["models"] else "engine"
    if parts[1] == "models":
        return "models"
    assert parts[1] in FEATURES, f"runtime.{parts[1]} belongs to no layer: add it to one (test_boundary.py)"
    return "features"


def may_import(src: str, dst: str) -> bool:
    """Whether layer ``src`` may import layer ``dst`` (its own or one below)."""
    return LAYERS.index(dst) <= LAYERS.index(src)


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every module a file imports: top level, inside functions (lazy) and under TYPE_CHECKING."""
    import ast

    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.add(target)
            for a in node.names:  # `from runtime import engine`: a module too
                sub = ROOT.joinpath(*target.split("."), a.name)
                if sub.with_suffix(".py").exists() or (sub / "__init__.py").exists():
                    out.add(f"{target}.{a.name}")
    return out


def import_graph() -> dict[str, set[str]]:
    """Project module -> project modules it imports (only modules that are files of the project)."""
    paths = {module_name(p): p for top in ("runtime", "dflash_cli", "tui") for p in sorted((ROOT / top).rglob("*.py"))}
    return {name: {m for m in imports_of(path) if m in paths and m != name} for name, path in paths.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle per strongly connected group of modules that import each other, as a path
    ``[a, b, ..., a]`` (Tarjan's algorithm, then a shortest way back around inside the group)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1 or v in graph.get(v, ()):
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    out = []
    for group in groups:
        members, start = set(group), group[0]
        prev: dict[str, str] = {}
        frontier, found = [start], None
        while frontier and found is None:  # breadth first from start back to start, inside the group
            nxt = []
            for v in frontier:
                for w in sorted(graph[v] & members):
                    if w == start:
                        found = v
                        break
                    if w not in prev:
                        prev[w] = v
                        nxt.append(w)
                if found is not None:
                    break
            frontier = nxt
        assert found is not None
        path = [found]
        while path[-1] != start:
            path.append(prev[path[-1]])
        out.append([start, *reversed(path[:-1]), start] if found != start else [start, start])
    return sorted(out)


def unit(module: str) -> str:
    """The package a module counts in for the package graph: runtime's subpackages and top-level
    files one each (the engine's models apart from its decoding files), each front end one."""
    parts = module.split(".")
    if parts[0] != "runtime":
        return parts[0]
    if parts[1:3] == ["engine", "models"]:
        return "runtime.engine.models"
    return ".".join(parts[:2])


def in_train(circle: list[str]) -> bool:
    return all(m.startswith("runtime.train.") for m in circle)


def test_layers_import_only_downwards():
    """No import runs upwards: the engine's models import no decoding file, the engine nothing of
    model resolution or features, model resolution no feature, features no front end, the TUI not
    the CLI (lazy and TYPE_CHECKING imports included)."""
    graph = import_graph()
    bad = sorted(
        f"{src} ({layer(src)}) -> {dst} ({layer(dst)})"
        for src, dsts in graph.items()
        for dst in dsts
        if not may_import(layer(src) or "", layer(dst) or "")
    )
    assert not bad, "imports against the layering:\n" + "\n".join(bad)
    edges = {(layer(s), layer(d)) for s, ds in graph.items() for d in ds}
    # the graph is not vacuous: each layer is used from above
    assert {
        ("engine-models", "core"),
        ("engine", "engine-models"),
        ("models", "engine-models"),
        ("features", "models"),
        ("features", "engine"),
        ("cli", "features"),
        ("tui", "engine"),
    } <= edges
    assert len([m for m in graph if layer(m) == "engine"]) >= 10
    assert len([m for m in graph if layer(m) == "engine-models"]) >= 8


def test_no_import_circles_outside_train():
    """No file imports itself around a circle of imports (lazy ones included): each circle is
    named as its path. Circles entirely inside runtime/train/ are the next test's."""
    found = [" -> ".join(c) for c in circles(import_graph()) if not in_train(c)]
    assert not found, "import circles:\n" + "\n".join(found)


def test_no_import_circles_in_train():
    found = [" -> ".join(c) for c in circles(import_graph()) if in_train(c)]
    assert not found, "import circles:\n" + "\n".join(found)


def test_packages_form_a_dag():
    """Packages (runtime's subpackages and top-level files, the engine's models apart, each front
    end) import each other without circles: a feature package may use another, never both ways."""
    graph = import_graph()
    packages: dict[str, set[str]] = {}
    for src, dsts in graph.items():
        packages.setdefault(unit(src), set()).update(unit(d) for d in dsts if unit(d) != unit(src))
    found = [" -> ".join(c) for c in circles(packages)]
    assert not found, "package circles:\n" + "\n".join(found)
    assert "runtime.engine.models" in packages and "runtime.quantize" in packages["dflash_cli"]


def test_runtime_imports_no_ui_package_anywhere():
    """Lazy and TYPE_CHECKING imports included (the import test above only runs the top levels)."""
    bad = sorted(
        f"{module_name(p)} imports {m}"
        for p in (ROOT / "runtime").rglob("*.py")
        for m in imports_of(p)
        if m.split(".")[0] in UI
    )
    assert not bad, "\n".join(bad)


def test_the_checks_catch_what_they_should(tmp_path):
    """The checkers flag what they should (so an empty result above means something)."""
    assert layer("runtime.engine.decode") == "engine" and layer("runtime.engine.models.drafter") == "engine-models"
    assert layer("runtime.models.hub") == "models" and layer("runtime.pipeline") == "features"
    assert not may_import("engine-models", "engine") and not may_import("models", "features")
    assert not may_import("engine", "models") and not may_import("features", "cli")
    assert not may_import("tui", "cli") and may_import("cli", "tui") and may_import("features", "features")
    # lazy and TYPE_CHECKING imports are read
    assert "runtime.pipeline" in imports_of(ROOT / "runtime" / "session.py")
    assert "runtime.pipeline" in imports_of(ROOT / "runtime" / "quantize" / "report.py")  # TYPE_CHECKING
    assert "runtime.engine.models.kernels" in imports_of(ROOT / "runtime" / "engine" / "models" / "device.py")  # lazy
    # circles: named as paths, every one found, shortest way round
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}, "f": {"g"}, "g": {"f", "h"}, "h": set()}
    assert circles(graph) == [["a", "b", "c", "a"], ["e", "e"], ["f", "g", "f"]]
    assert circles({"a": {"b"}, "b": set()}) == []
    assert in_train(["runtime.train.api", "runtime.train.answers", "runtime.train.api"])
    assert not in_train(["runtime.train.api", "runtime.pipeline", "runtime.train.api"])
    assert unit("runtime.engine.models.kernels.ops") == "runtime.engine.models"
    assert unit("runtime.engine.decode") == "runtime.engine" and unit("dflash_cli.server.app") == "dflash_cli"
