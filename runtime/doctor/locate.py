"""Locating the pair for the doctor, from the cache only (it never downloads or converts): a local
folder, a Hub id in the Hugging Face cache, or the embedded pair; and the check of a folder's files."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runtime.doctor.report import Check, fail
from runtime.errors import DFlashError, ModelLoadError, ModelNotFoundError
from runtime.models import embedded
from runtime.models.files import FolderReport, inspect_folder
from runtime.models.hub import PartialDownloadError, download_model, looks_like_repo_id


@dataclass
class Located:
    """A located model folder (or why it could not be located)."""

    name: str
    folder: Path | None = None
    report: FolderReport | None = None
    checks: list[Check] = field(default_factory=list)


def locate_hub(repo: str, what: str, cache_dir: Path | None, revision: str | None) -> Located:
    from runtime.models.store import _expected_files

    m = Located(repo)
    fix = f"dflash download {repo}"
    try:
        folder = download_model(repo, what, cache_dir=cache_dir, revision=revision, offline=True)
    except PartialDownloadError as e:
        m.checks.append(fail(what, e, f"run `{fix}` to finish the download", 3))
        return m
    if folder is None:
        m.checks.append(fail(what, f"{what} {repo} is not in the Hugging Face cache", f"run `{fix}`", 3))
        return m
    m.folder = folder
    m.report = inspect_folder(folder, _expected_files(folder.parent.parent, folder.name))
    return m


def locate(ref: str, what: str, opts: Any) -> Located:
    """Find ``ref`` (a folder, a Hub id, or "embedded") without downloading or converting."""
    if ref == "embedded":
        if what == "target":
            m = Located(embedded.TARGET_NAME)
            if embedded.is_installed(opts.models_dir):
                m.folder = embedded.embedded_target_dir(opts.models_dir)
            else:
                try:
                    embedded.part_paths()
                    m.checks.append(
                        Check(
                            what,
                            "warn",
                            f"the embedded target {embedded.TARGET_NAME} is not converted yet "
                            "(first use converts it, about a minute)",
                            "run `dflash setup` now",
                        )
                    )
                except DFlashError as e:
                    m.checks.append(fail(what, e, f"run: {embedded.INSTALL_HINT}"))
        else:
            m = Located("dflash/" + embedded.DRAFTER_DIR.name)
            try:
                m.folder = embedded.embedded_drafter_dir()
            except DFlashError as e:
                m.checks.append(fail(what, e, "reinstall dflash (the drafter ships as package data)"))
        if m.folder is not None:
            m.report = inspect_folder(m.folder)
        return m
    path = Path(ref).expanduser()
    if path.is_dir():
        return Located(ref, path, inspect_folder(path))
    if looks_like_repo_id(ref):
        return locate_hub(ref, what, opts.hf_cache_dir, opts.revision)
    m = Located(ref)
    m.checks.append(fail(what, ModelNotFoundError(f"{what} {ref!r} is neither a local folder nor a Hub id (org/name)")))
    return m


def files_check(what: str, m: Located) -> Check | None:
    if m.folder is None or m.report is None:
        return None
    r = m.report
    if not r.ok:
        hub = looks_like_repo_id(m.name) and not Path(m.name).exists()
        fix = f"run `dflash download {m.name}` to fetch what is missing" if hub else "copy or re-download the folder"
        return fail(what, f"{what} {m.name}: {'; '.join(r.problems)}", fix, ModelLoadError.exit_code)
    return Check(what, "ok", f"{what} {m.name}: {r.params / 1e6:,.1f}M parameters in {m.folder}")
