"""runtime/ imports no UI package (typer, click, rich, textual)."""

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
# core: frozen configs, errors and text decoding rules; engine: the decode loop and its parts (runtime/engine); features:
# everything else in runtime/ (model resolution and loading, bench, quantize, train, the remote
# client, doctor, the Backend protocol, sessions); then the two front ends.
ROOT = Path(runtime.__file__).parent.parent
FEATURES = ("models", "bench", "quantize", "client", "train", "pipeline", "doctor", "session", "backend", "fim")
ALLOWED = {
    "core": {"core"},
    "engine": {"core", "engine"},
    "features": {"core", "engine", "features", "api"},
    "api": {"core", "engine", "features", "api"},
    "tui": {"core", "engine", "features", "api", "tui"},
    "cli": {"core", "engine", "features", "api", "tui", "cli"},
}


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
        return "api"  # runtime/__init__.py: the re-exports front ends use
    if parts[1] in ("config", "errors", "textio"):  # textio: UTF-8 rules for text in, beside errors
        return "core"
    if parts[1] == "engine":
        return "engine"
    assert parts[1] in FEATURES, f"runtime.{parts[1]} belongs to no layer: add it to FEATURES (or engine)"
    return "features"


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
    """Project module -> project modules it imports."""
    graph: dict[str, set[str]] = {}
    for top in ("runtime", "dflash_cli", "tui"):
        for path in sorted((ROOT / top).rglob("*.py")):
            graph[module_name(path)] = {m for m in imports_of(path) if layer(m) is not None}
    return graph


def test_layers_import_only_downwards():
    """engine imports nothing from features, features nothing from the CLI or the TUI, the TUI
    nothing from the CLI (a `farm-studio`-style view of the import graph, checked)."""
    graph = import_graph()
    bad = sorted(
        f"{src} ({layer(src)}) -> {dst} ({layer(dst)})"
        for src, dsts in graph.items()
        for dst in dsts
        if layer(dst) not in ALLOWED[layer(src) or ""]
    )
    assert not bad, "imports against the layering:\n" + "\n".join(bad)
    edges = {(layer(s), layer(d)) for s, ds in graph.items() for d in ds}
    # the graph is not vacuous: each layer is used from above
    assert {("engine", "core"), ("features", "engine"), ("cli", "features"), ("tui", "engine")} <= edges
    assert len([m for m in graph if layer(m) == "engine"]) >= 10


def test_layering_check_catches_a_violation():
    """The checker flags what it should (so an empty result above means something)."""
    assert layer("runtime.engine.decode") == "engine" and layer("runtime.models.hub") == "features"
    assert "features" not in ALLOWED["engine"] and "cli" not in ALLOWED["features"]
    assert "tui" not in ALLOWED["features"] and "cli" not in ALLOWED["tui"]
    assert "runtime.pipeline" in imports_of(ROOT / "runtime" / "session.py")
