"""Models on disk: the Hugging Face cache and dflash's own model folder.

``scan`` lists every cached model with its kind (target or DFlash drafter), disk size, last use
and completeness; ``find_pairs`` groups them into target + drafter pairs (presets, and pairs that
were downloaded or run together); ``remove`` deletes them. The Hub cache is read in the layout
huggingface_hub writes (``models--org--name/{refs, blobs, snapshots/<commit>, trees/<commit>.json}``),
so models fetched by other tools are listed too.

``UsageLog`` is a small JSON file that remembers when dflash last loaded or downloaded each model
and which pairs belong together. Nothing here reads environment variables: callers pass folders.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.errors import ConfigError, ModelNotFoundError
from runtime.models import embedded, presets
from runtime.models.files import inspect_folder
from runtime.models.hub import MODEL_FILE_PATTERNS

TARGET, DRAFTER, OTHER = "target", "drafter", "model"


@dataclass(frozen=True)
class CachedModel:
    """One model on disk.

    Attributes:
        name: Hub id (``org/name``) or folder name (dflash's own models).
        kind: "target", "drafter" or "model" (not a causal LM dflash knows how to use).
        source: "hub" (Hugging Face cache), "dflash" (dflash's model folder) or "package" (shipped data).
        path: what ``remove`` deletes: the repo folder in the Hub cache, or the model folder.
        folder: the folder to load (the snapshot of ``refs/main``), None when there is none.
        revision: the snapshot's commit (Hub models).
        size_bytes: disk use, unfinished downloads included.
        last_used: when dflash last loaded or downloaded it (else when it last changed on disk).
        problems: why it cannot be used (missing files, truncated weights); empty when usable.
    """

    name: str
    kind: str
    source: str
    path: Path
    folder: Path | None
    revision: str | None
    size_bytes: int
    last_used: float | None
    problems: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """True when the model folder is complete."""
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (``dflash models --json``)."""
        return {
            "name": self.name,
            "kind": self.kind,
            "source": self.source,
            "path": str(self.path),
            "folder": str(self.folder) if self.folder else None,
            "revision": self.revision,
            "size_bytes": self.size_bytes,
            "last_used": self.last_used,
            "ok": self.ok,
            "problems": list(self.problems),
        }


@dataclass(frozen=True)
class CachedPair:
    """A target and its drafter, both on disk.

    Attributes:
        name: the preset name, or ``target + drafter`` for pairs named on the command line.
        preset: the preset name, if any.
    """

    name: str
    target: CachedModel
    drafter: CachedModel
    preset: str | None = None

    @property
    def size_bytes(self) -> int:
        """Disk use of both models."""
        return self.target.size_bytes + self.drafter.size_bytes

    @property
    def last_used(self) -> float | None:
        """The later of the two models' last use."""
        times = [t for t in (self.target.last_used, self.drafter.last_used) if t is not None]
        return max(times) if times else None

    @property
    def ok(self) -> bool:
        """True when both models are complete."""
        return self.target.ok and self.drafter.ok

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (``dflash models --json``)."""
        return {
            "name": self.name,
            "preset": self.preset,
            "target": self.target.name,
            "drafter": self.drafter.name,
            "size_bytes": self.size_bytes,
            "last_used": self.last_used,
            "ok": self.ok,
        }


def usage_key(folder: Path) -> str:
    """The key a model folder is remembered under: its Hub repo folder, or the folder itself."""
    folder = Path(folder).expanduser().absolute()
    if folder.parent.name == "snapshots":
        folder = folder.parent.parent
    return str(folder)


class UsageLog:
    """When dflash last used each model, and which pairs belong together (a JSON file).

    Args:
        path: the file (created on the first ``record``).
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._cache: dict[str, Any] | None = None

    def _read(self) -> dict[str, Any]:
        if self._cache is not None:
            return self._cache
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            data = None
        if (
            not isinstance(data, dict)
            or not isinstance(data.get("used", {}), dict)
            or not isinstance(data.get("pairs", []), list)
        ):
            data = {}  # unreadable: start afresh (it only holds last-use times)
        data.setdefault("used", {})
        data.setdefault("pairs", [])
        self._cache = data
        return data

    def _write(self, data: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(self.path)
        self._cache = data

    def record(
        self,
        folders: Iterable[Path | None],
        pair: tuple[Path, Path] | None = None,
        pair_name: str | None = None,
        when: float | None = None,
    ) -> None:
        """Note that ``folders`` were just used (and, optionally, that they form a pair).

        Args:
            folders: model folders (None entries are skipped).
            pair: (target folder, drafter folder) to remember as a pair.
            pair_name: the preset the pair came from, if any.
            when: timestamp (default: now).
        """
        now = time.time() if when is None else when
        self._cache = None  # re-read: another process may have written since
        data = self._read()
        for f in folders:
            if f is not None:
                data["used"][usage_key(f)] = now
        if pair is not None:
            t, d = usage_key(pair[0]), usage_key(pair[1])
            data["pairs"] = [p for p in data["pairs"] if (p.get("target"), p.get("drafter")) != (t, d)]
            data["pairs"].append({"target": t, "drafter": d, "name": pair_name})
        self._write(data)

    def last_used(self, path: Path) -> float | None:
        """When the model at ``path`` (a repo or model folder) was last used, if ever."""
        value = self._read()["used"].get(usage_key(path))
        return float(value) if isinstance(value, (int, float)) else None

    def pairs(self) -> list[dict[str, Any]]:
        """Recorded pairs: dicts with ``target``, ``drafter`` (usage keys) and ``name``."""
        return [p for p in self._read()["pairs"] if isinstance(p, dict)]

    def forget(self, paths: Iterable[Path]) -> None:
        """Drop removed models (and the pairs they were part of)."""
        keys = {usage_key(p) for p in paths}
        self._cache = None
        data = self._read()
        data["used"] = {k: v for k, v in data["used"].items() if k not in keys}
        data["pairs"] = [p for p in data["pairs"] if p.get("target") not in keys and p.get("drafter") not in keys]
        self._write(data)


def hub_cache_dir(cache_dir: Path | None = None) -> Path:
    """The Hugging Face cache in use (``cache_dir``, else huggingface_hub's default)."""
    if cache_dir is not None:
        return Path(cache_dir)
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def classify(config: dict[str, Any]) -> str:
    """ "drafter" for DFlash drafter configs, "target" for causal LMs, else "model"."""
    archs = [str(a) for a in config.get("architectures") or []]
    if (
        "dflash_config" in config
        or any("DFlash" in a for a in archs)
        or ("block_size" in config and ("mask_token_id" in config or "target_layer_ids" in config))
    ):
        return DRAFTER
    if any(a.endswith(("ForCausalLM", "ForConditionalGeneration", "LMHeadModel")) for a in archs):
        return TARGET
    return OTHER


def _read_config(folder: Path | None) -> dict[str, Any]:
    if folder is None:
        return {}
    try:
        data = json.loads((folder / "config.json").read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _disk_size(root: Path) -> int:
    """Bytes of the regular files under ``root`` (links are not followed: blobs count once)."""
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue
            if not os.path.islink(os.path.join(dirpath, name)):
                total += st.st_size
    return total


def _expected_files(repo_dir: Path, commit: str) -> tuple[str, ...]:
    """Files of the Hub's tree listing (cached by huggingface_hub) that dflash downloads."""
    try:
        data = json.loads((repo_dir / "trees" / f"{commit}.json").read_text())
        names = list((data.get("files") or {}).keys())
    except (OSError, ValueError, AttributeError):
        return ()
    from huggingface_hub.utils import filter_repo_objects

    return tuple(filter_repo_objects(items=names, allow_patterns=MODEL_FILE_PATTERNS))


def _snapshot(repo_dir: Path) -> tuple[Path | None, str | None]:
    """The snapshot ``refs/main`` points at (else any ref, else the newest snapshot)."""
    refs = repo_dir / "refs"
    candidates = [refs / "main"] + sorted(p for p in refs.rglob("*") if p.is_file() and p.name != "main")
    for ref in candidates:
        try:
            commit = ref.read_text().strip()
        except OSError:
            continue
        if commit and (repo_dir / "snapshots" / commit).is_dir():
            return repo_dir / "snapshots" / commit, commit
    snaps = sorted((p for p in (repo_dir / "snapshots").glob("*") if p.is_dir()), key=lambda p: p.stat().st_mtime)
    if snaps:
        return snaps[-1], snaps[-1].name
    return None, None


def _changed(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


def scan_hub_repo(repo_dir: Path, usage: UsageLog | None = None) -> CachedModel:
    """Describe one ``models--org--name`` folder of the Hub cache."""
    name = repo_dir.name.removeprefix("models--").replace("--", "/")
    folder, commit = _snapshot(repo_dir)
    problems: list[str] = []
    if folder is None:
        problems.append("no snapshot: the download never finished")
    else:
        report = inspect_folder(folder, _expected_files(repo_dir, commit or ""))
        problems.extend(report.problems)
    last = usage.last_used(repo_dir) if usage else None
    return CachedModel(
        name=name,
        kind=classify(_read_config(folder)),
        source="hub",
        path=repo_dir,
        folder=folder,
        revision=commit,
        size_bytes=_disk_size(repo_dir),
        last_used=last if last is not None else _changed(folder or repo_dir),
        problems=tuple(problems),
    )


def scan_folder(folder: Path, usage: UsageLog | None = None, source: str = "dflash") -> CachedModel:
    """Describe a plain model folder (dflash's converted or quantized models, package data)."""
    report = inspect_folder(folder)
    last = usage.last_used(folder) if usage else None
    return CachedModel(
        name=folder.name,
        kind=classify(_read_config(folder)),
        source=source,
        path=folder,
        folder=folder,
        revision=None,
        size_bytes=_disk_size(folder),
        last_used=last if last is not None else _changed(folder),
        problems=report.problems,
    )


def scan(
    cache_dir: Path | None = None, models_dir: Path | None = None, usage: UsageLog | None = None
) -> list[CachedModel]:
    """Every model in the Hub cache and in dflash's model folder, sorted by name.

    Args:
        cache_dir: the Hub cache (None: huggingface_hub's default).
        models_dir: dflash's model folder (None: skip it).
        usage: the usage log for last-use times.
    """
    out: list[CachedModel] = []
    hub = hub_cache_dir(cache_dir)
    if hub.is_dir():
        out.extend(scan_hub_repo(p, usage) for p in sorted(hub.glob("models--*")) if p.is_dir())
    if models_dir is not None and Path(models_dir).is_dir():
        for p in sorted(Path(models_dir).iterdir()):
            if p.is_dir() and not p.name.endswith(".tmp") and (p / "config.json").exists():
                out.append(scan_folder(p, usage))
    return sorted(out, key=lambda m: (m.name.lower(), m.source))


def embedded_drafter(usage: UsageLog | None = None) -> CachedModel | None:
    """The drafter shipped with dflash, when the package has it."""
    if not (embedded.DRAFTER_DIR / "config.json").exists():
        return None
    return scan_folder(embedded.DRAFTER_DIR, usage, source="package")


def _by_name(models: Sequence[CachedModel], name: str, source: str | None = None) -> CachedModel | None:
    for m in models:
        if m.name.lower() == name.lower() and (source is None or m.source == source):
            return m
    return None


def preset_members(preset: presets.Preset, models: Sequence[CachedModel]) -> tuple[CachedModel | None, ...]:
    """(target, drafter) of a preset as found on disk (None where absent)."""
    if preset.target == "embedded":
        target = _by_name(models, embedded.TARGET_DIRNAME, "dflash")
        drafter = embedded_drafter()
        return target, drafter
    return _by_name(models, preset.target, "hub"), _by_name(models, preset.drafter, "hub")


def find_pairs(models: Sequence[CachedModel], usage: UsageLog | None = None) -> list[CachedPair]:
    """Pairs whose two models are both on disk: presets first, then pairs recorded in ``usage``."""
    pairs: list[CachedPair] = []
    seen: set[tuple[str, str]] = set()
    for p in presets.PRESETS.values():
        target, drafter = preset_members(p, models)
        if target is not None and drafter is not None:
            pairs.append(CachedPair(p.name, target, drafter, preset=p.name))
            seen.add((usage_key(target.path), usage_key(drafter.path)))
    by_key = {usage_key(m.path): m for m in models}
    for rec in usage.pairs() if usage else []:
        key = (str(rec.get("target")), str(rec.get("drafter")))
        t, d = by_key.get(key[0]), by_key.get(key[1])
        if t is None or d is None or key in seen:
            continue
        seen.add(key)
        name = rec.get("name") or f"{t.name} + {d.name}"
        pairs.append(
            CachedPair(str(name), t, d, preset=rec.get("name") if rec.get("name") in presets.PRESETS else None)
        )
    return pairs


def select(names: Sequence[str], models: Sequence[CachedModel]) -> list[CachedModel]:
    """The models ``names`` refer to: Hub ids, folder names, or presets (both members of the pair).

    Raises:
        ModelNotFoundError: a name matches nothing on disk (nothing is selected then).
    """
    chosen: dict[Path, CachedModel] = {}
    for name in names:
        preset = presets.PRESETS.get(name.lower())
        if preset is not None:
            found = [m for m in preset_members(preset, models) if m is not None and m.source != "package"]
            if not found:
                raise ModelNotFoundError(f"preset {name!r} is not on disk; `dflash models` lists what is")
        else:
            m = _by_name(models, name)
            if m is None:
                raise ModelNotFoundError(f"no cached model named {name!r}; `dflash models` lists what is on disk")
            if m.source == "package":
                raise ConfigError(f"{name!r} ships inside the dflash package and cannot be removed")
            found = [m]
        for m in found:
            chosen[m.path] = m
    return list(chosen.values())


def remove(models: Sequence[CachedModel], roots: Sequence[Path], usage: UsageLog | None = None) -> int:
    """Delete models from disk; return the bytes freed.

    Args:
        models: what ``select``/``scan`` returned.
        roots: the folders deletions must stay inside (the Hub cache, dflash's model folder).
        usage: forget the removed models there.

    Raises:
        ConfigError: a model lies outside ``roots`` or is package data (nothing is deleted then).
    """
    resolved = [Path(r).resolve() for r in roots]
    for m in models:
        p = m.path.resolve()
        if m.source == "package" or not any(p != r and p.is_relative_to(r) for r in resolved):
            raise ConfigError(f"refusing to delete {m.path}: it is not inside {', '.join(map(str, roots))}")
    freed = 0
    for m in models:
        freed += m.size_bytes
        shutil.rmtree(m.path)
        if m.source == "hub":
            shutil.rmtree(m.path.parent / ".locks" / m.path.name, ignore_errors=True)
    if usage is not None:
        usage.forget(m.path for m in models)
    return freed
