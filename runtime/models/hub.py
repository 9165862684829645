"""Resolve model references: a local folder or a Hugging Face Hub id (cache first, then download).

Only the files a model needs are ever fetched: safetensors weights, JSON configs and tokenizer
files. Pickle weights (``*.bin``, ``*.pt``, ``*.pth``, ``*.ckpt``) are never downloaded or loaded.
"""

from __future__ import annotations

import re
from pathlib import Path

from runtime.errors import ModelLoadError, ModelNotFoundError


class PartialDownloadError(ModelNotFoundError):
    """A cached Hub snapshot lacks files (an interrupted download) and the Hub may not be used."""


MODEL_FILE_PATTERNS = [
    "*.json",
    "*.safetensors",
    "tokenizer*",
    "*.model",
    "*.tiktoken",
    "merges.txt",
    "vocab.txt",
    "*.jinja",
    "*.md",
]
# The small files (configs, tokenizer, chat template) that are enough to check a pair before
# any weights are fetched.
CONFIG_PATTERNS = ["*.json", "*.jinja", "tokenizer*", "*.model", "*.tiktoken", "merges.txt", "vocab.txt"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def looks_like_repo_id(ref: str) -> bool:
    """True for ``org/name`` strings that are not existing local paths."""
    return bool(_REPO_ID.match(ref)) and not Path(ref).expanduser().exists()


def check_model_folder(folder: Path, what: str) -> None:
    """Make sure a folder holds a config and safetensors weights.

    Raises:
        ModelLoadError: naming the missing file and how to fix it.
    """
    if not (folder / "config.json").exists():
        raise ModelLoadError(f"{what} folder {folder} has no config.json; re-download it (dflash download)")
    index = folder / "model.safetensors.index.json"
    if index.exists():
        from runtime.engine.models.drafter_schema import read_weight_index

        shards = read_weight_index(index)  # a truncated or malformed index: exit 4 naming it and the field
        missing = sorted(s for s in shards if not (folder / s).exists())
        if missing:
            raise ModelLoadError(
                f"{what} folder {folder} lacks weight shard {missing[0]}; re-download it (dflash download)"
            )
    elif not any(folder.glob("*.safetensors")):
        pickles = [p.name for p in folder.glob("*.bin")] + [p.name for p in folder.glob("*.pt*")]
        hint = " (only pickle weights found, which dflash never loads)" if pickles else ""
        raise ModelLoadError(f"{what} folder {folder} has no .safetensors weights{hint}")


def resolve_model(
    ref: str,
    what: str = "model",
    *,
    cache_dir: str | Path | None = None,
    revision: str | None = None,
    offline: bool = False,
    token: str | None = None,
) -> Path:
    """Find a model folder for ``ref``.

    Args:
        ref: a local folder, or a Hub id ``org/name``.
        what: "target" or "drafter", used in messages.
        cache_dir: Hugging Face cache to use (None: huggingface_hub's default, honouring HF_HOME).
        revision: branch, tag or commit on the Hub.
        offline: never touch the network; use the cache only.
        token: Hub token for gated repos.

    Returns:
        The folder (a cache snapshot for Hub ids).

    Raises:
        ModelNotFoundError: not a folder, not cached, and not downloadable.
        ModelLoadError: found but incomplete.
    """
    path = Path(ref).expanduser()
    if path.is_dir():
        check_model_folder(path, what)
        return path
    if path.exists():
        raise ModelNotFoundError(f"{what} {ref!r} is a file, not a model folder")
    if not _REPO_ID.match(ref):
        raise ModelNotFoundError(f"{what} {ref!r} is neither a local folder nor a Hugging Face repo id (org/name)")
    try:
        folder = download_model(ref, what, cache_dir=cache_dir, revision=revision, offline=True, token=token)
    except PartialDownloadError:
        if offline:
            raise
        folder = None  # known to be incomplete: let the download finish it
    if folder is not None:
        try:
            check_model_folder(folder, what)
            return folder
        except ModelLoadError:
            if offline:
                raise
            folder = None  # incomplete cache entry: let the download resume it
    if offline:
        raise ModelNotFoundError(
            f"{what} {ref!r} is not in the Hugging Face cache and offline mode is on; "
            f"run `dflash download {ref}` where the Hub is reachable, or pass a local folder"
        )
    folder = download_model(ref, what, cache_dir=cache_dir, revision=revision, offline=False, token=token)
    assert folder is not None
    check_model_folder(folder, what)
    return folder


def download_model(
    repo_id: str,
    what: str = "model",
    *,
    cache_dir: str | Path | None = None,
    revision: str | None = None,
    offline: bool = False,
    token: str | None = None,
    allow_patterns: list[str] | None = None,
    endpoint: str | None = None,
) -> Path | None:
    """Fetch (or find in the cache) the files a model needs with ``snapshot_download``.

    Files already in the cache are not fetched again; a dropped connection is resumed from the
    byte where it stopped (HTTP Range). Progress bars go to stderr.

    Args:
        allow_patterns: which files to fetch (default ``MODEL_FILE_PATTERNS``: never pickle weights).
        endpoint: Hub URL (None: huggingface_hub's default, https://huggingface.co).

    Returns:
        The snapshot folder, or None when ``offline`` and the repo is not cached.

    Raises:
        PartialDownloadError: ``offline`` and the cached snapshot is known to lack files.
        ModelNotFoundError: the repo does not exist, is gated, or the Hub is unreachable.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        from huggingface_hub.errors import IncompleteSnapshotError
    except ImportError:  # huggingface_hub before the tree-listing cache cannot tell

        class IncompleteSnapshotError(Exception):  # type: ignore[no-redef]
            pass

    try:
        out = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=str(cache_dir) if cache_dir else None,
            allow_patterns=allow_patterns or MODEL_FILE_PATTERNS,
            local_files_only=offline,
            token=token,
            endpoint=endpoint,
        )
        return Path(out)
    except IncompleteSnapshotError as e:
        found = re.search(r"(\d+) file\(s\) are missing \(([^,)]+)", str(e))
        what_missing = f" ({found.group(1)} file(s) missing, e.g. {found.group(2)})" if found else ""
        raise PartialDownloadError(
            f"{what} {repo_id!r} is only partly downloaded{what_missing}; "
            f"run `dflash download {repo_id}` where the Hub is reachable to finish it"
        ) from e
    except GatedRepoError as e:
        raise ModelNotFoundError(
            f"{what} {repo_id!r} is gated: accept its license on huggingface.co and set HF_TOKEN"
        ) from e
    except RepositoryNotFoundError as e:
        raise ModelNotFoundError(f"{what} {repo_id!r} does not exist on the Hugging Face Hub (check the id)") from e
    except RevisionNotFoundError as e:
        raise ModelNotFoundError(f"{what} {repo_id!r} has no revision {revision!r}") from e
    except LocalEntryNotFoundError as e:
        if offline:
            return None
        raise ModelNotFoundError(
            f"{what} {repo_id!r} is not cached and the Hugging Face Hub is unreachable; "
            "check the network (or HF_ENDPOINT), or pass a local folder"
        ) from e
    except (HfHubHTTPError, OSError) as e:
        if offline:
            return None
        raise ModelNotFoundError(
            f"cannot download {what} {repo_id!r}: {str(e).splitlines()[0]}; "
            "run the same command again to resume (finished files are kept)"
        ) from e
    except Exception as e:  # the HTTP client's own errors (bad HF_ENDPOINT, TLS, proxy)
        if type(e).__module__.split(".")[0] not in ("httpx", "httpx2", "httpcore", "requests", "urllib3"):
            raise
        if offline:
            return None
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ModelNotFoundError(
            f"cannot reach the Hugging Face Hub for {what} {repo_id!r}: {first}; check the network or HF_ENDPOINT"
        ) from e
