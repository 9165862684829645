"""A target's config read without its weights (what pair checks and downloads need before loading).
A drafter's is ``runtime.engine.models.drafter_config.read_draft_config``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from runtime.errors import ModelLoadError, UnsupportedModelError


def read_target_config(target_dir: Path) -> Any:
    """The transformers config of a target folder, without weights.

    Raises:
        UnsupportedModelError: transformers does not know the architecture.
        ModelLoadError: the config cannot be read.
    """
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(target_dir), local_files_only=True, trust_remote_code=False)
    except (ValueError, KeyError) as e:
        raise UnsupportedModelError(
            f"transformers cannot read the target config in {target_dir}: {str(e).splitlines()[0]}"
        ) from e
    except OSError as e:
        raise ModelLoadError(f"cannot read the target config in {target_dir}: {e}") from e
