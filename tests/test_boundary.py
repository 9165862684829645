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
