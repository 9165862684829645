"""The documentation stays true to the repository: links resolve, the code's pointers into docs/
exist, nothing points to files outside the repository, and the README's first two commands are
the ones CI runs and the CLI accepts."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[1]
CODE_DIRS = ("runtime", "dflash_cli", "tui", "scripts")
# Files that once lived beside the repository (never part of it): nothing may point to them.
OUTSIDE = (
    "DFLASH.md",
    "TRAINING-NOTES.md",
    "LLAMACPP.md",
    "OFFLINE-MODELS.md",
    "DESIGN.md",
    "STYLE.md",
    "shared/tools",
)

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")
DOCS_PATH = re.compile(r"\bdocs/[A-Za-z0-9_./-]*[A-Za-z0-9_-]\.md\b")


def markdown_files() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return [f for f in files if f.exists()]


def relative_links(md: Path) -> list[str]:
    text = INLINE_CODE.sub("", FENCE.sub("", md.read_text(encoding="utf-8")))
    return [t for t in LINK.findall(text) if not re.match(r"^[a-z][a-z0-9+.-]*:", t, re.I)]


def code_files() -> list[Path]:
    return [p for d in CODE_DIRS for p in sorted((ROOT / d).rglob("*")) if p.suffix in (".py", ".c") and p.is_file()]


def test_docs_exist_and_are_indexed_from_the_readme():
    assert (ROOT / "CHANGELOG.md").is_file()
    assert len(list((ROOT / "docs").glob("*.md"))) >= 5
    readme_links = relative_links(ROOT / "README.md")
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert f"docs/{page.name}" in readme_links, f"README.md does not link docs/{page.name}"


@pytest.mark.parametrize("md", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves_without_anchor(md: Path):
    bad = []
    for target in relative_links(md):
        if "#" in target:
            bad.append(f"{target} (anchor: link the file, anchors are not checked)")
        elif not (md.parent / target).resolve().exists():
            bad.append(f"{target} (no such file)")
        elif not (md.parent / target).resolve().is_relative_to(ROOT):
            bad.append(f"{target} (outside the repository)")
    assert not bad, f"{md.relative_to(ROOT)}: " + "; ".join(bad)


def test_docs_paths_named_in_the_code_exist():
    named: dict[str, list[str]] = {}
    for f in code_files():
        for path in DOCS_PATH.findall(f.read_text(encoding="utf-8", errors="replace")):
            named.setdefault(path, []).append(str(f.relative_to(ROOT)))
    assert named, "no docstring or comment names a file under docs/"
    missing = {p: where for p, where in named.items() if not (ROOT / p).is_file()}
    assert not missing, f"named but missing: {missing}"


def test_nothing_points_outside_the_repository():
    hits = []
    files = [*code_files(), *(p for p in sorted((ROOT / "tests").rglob("*.py")) if p.name != "test_docs.py")]
    for f in [*files, *markdown_files()]:
        text = f.read_text(encoding="utf-8", errors="replace")
        hits += [f"{f.relative_to(ROOT)}: {name}" for name in OUTSIDE if name in text]
    assert not hits, hits


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines (at most 250; details go to docs/)"


def readme_first_commands() -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(r"^```(?:bash|sh)?\n(.*?)^```", text, re.S | re.M)
    assert block, "README.md has no code block"
    assert text.index(block.group(0)) < text.index("\n## "), "the commands must come before the first section"
    return [line for line in block.group(1).splitlines() if line.strip()]


def ci_test_command() -> str:
    lines = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    i = next(
        n for n, line in enumerate(lines) if line.startswith("#") and line.rstrip().endswith("README's test command:")
    )
    return lines[i + 1].strip()


def ci_install_extras() -> str:
    text = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    m = re.search(r"pip install .*?-e '\.\[([^\]]*)\]'", text)
    assert m, ".ci/run installs no extras"
    return m.group(1)


def test_readme_first_two_commands_are_setup_run_and_the_ci_test_command():
    first, second = readme_first_commands()[:2]
    assert len(readme_first_commands()) == 2
    assert "dflash setup" in first and "dflash run" in first
    assert second.endswith(ci_test_command()), f"{second!r} does not run .ci/run's {ci_test_command()!r}"
    assert f"-e '.[{ci_install_extras()}]'" in second, "the README's test line installs other extras than CI"


def test_readme_first_command_is_accepted_by_the_cli():
    from dflash_cli.app import app

    runner = CliRunner()
    segments = [shlex.split(s) for s in readme_first_commands()[0].split("&&")]
    dflash = [argv[1:] for argv in segments if argv and argv[0] == "dflash"]
    assert dflash, "the first command runs no dflash command"
    for argv in dflash:
        sub, flags = argv[0], [a.split("=")[0] for a in argv[1:] if a.startswith("-")]
        result = runner.invoke(app, [sub, "--help"], env={"COLUMNS": "250"})
        assert result.exit_code == 0, f"dflash {sub} --help: {result.output}"
        for flag in flags:
            assert flag in result.output, f"dflash {sub} has no {flag}"


def test_distribution_name_is_not_the_taken_dflash_and_keeps_the_command():
    import tomllib

    from runtime.config import DISTRIBUTION

    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    # "dflash" on PyPI is z-lab's own DFlash package (which also installs a `dflash` command)
    assert project["name"] == DISTRIBUTION and DISTRIBUTION.lower().replace("_", "-") != "dflash"
    assert project["scripts"]["dflash"] == "dflash_cli.app:main"


def test_install_hints_and_version_lookups_name_this_distribution():
    from runtime.config import DISTRIBUTION
    from runtime.models.embedded import INSTALL_HINT
    from runtime.models.quant_schemes import SCHEMES

    assert f"pip install '{DISTRIBUTION}[embedded]'" in INSTALL_HINT
    assert f"pip install '{DISTRIBUTION}[quantize]'" in SCHEMES["int8"].install
    stale = re.compile(r"""version\(\s*["']dflash["']\s*\)|["']dflash\[""")
    files = [*code_files(), *markdown_files()]
    hits = [str(f.relative_to(ROOT)) for f in files if stale.search(f.read_text(encoding="utf-8", errors="replace"))]
    assert not hits, f"name the distribution {DISTRIBUTION!r}, not 'dflash' (z-lab's package): {hits}"
