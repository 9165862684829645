"""`dflash download`: fetch a target and its DFlash drafter as one checked, resumable pair.

Progress and notes go to stderr; stdout gets one line per model, ``target<TAB>folder`` and
``drafter<TAB>folder``, so scripts can pick the folders up.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from ..common import OfflineOpt, RevisionOpt, load_options, models_dir, usage_log_path
from ..errors import handle_errors
from .models import human_size


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _folder_size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


@handle_errors
def download(
    name: Annotated[
        str | None,
        typer.Argument(
            help="Preset (see `dflash models --presets`) or Hub repo id of the target; none: the embedded pair.",
            show_default=False,
        ),
    ] = None,
    drafter: Annotated[
        str | None,
        typer.Option("--drafter", help="Drafter repo id to pair with the target ('none': the target alone)."),
    ] = None,
    revision: RevisionOpt = None,
    offline: OfflineOpt = False,
) -> None:
    """Download a target and its drafter (safetensors only), check the pair, print the folders."""
    from runtime.models.download import download_pair, plan_download
    from runtime.models.store import UsageLog

    opts = load_options(offline, revision)
    req = plan_download(name, drafter)
    label = f"{req.preset}: " if req.preset else ""
    pair = f"{req.target} + {req.drafter}" if req.drafter else f"{req.target} (no drafter)"
    _say(f"{label}{pair}".replace("embedded + embedded", "the embedded pair"))
    try:
        got = download_pair(
            req,
            cache_dir=opts.hf_cache_dir,
            models_dir=models_dir(),
            revision=opts.revision,
            token=opts.token,
            endpoint=os.environ.get("HF_ENDPOINT") or None,
            offline=opts.offline,
            progress=_say,
        )
    except KeyboardInterrupt:
        _say("\ndflash: download interrupted; run the same command again to resume (finished files are kept)")
        raise typer.Exit(code=130) from None
    try:
        UsageLog(usage_log_path()).record(
            [got.target_dir, got.drafter_dir],
            pair=(got.target_dir, got.drafter_dir) if got.drafter_dir else None,
            pair_name=req.preset,
        )
    except OSError:
        pass
    parts = [f"target {human_size(_folder_size(got.target_dir))} ({got.target_report.params / 1e6:,.1f}M parameters)"]
    if got.drafter_dir is not None and got.drafter_report is not None:
        parts.append(
            f"drafter {human_size(_folder_size(got.drafter_dir))} ({got.drafter_report.params / 1e6:,.1f}M parameters)"
        )
    _say("ready: " + ", ".join(parts))
    if req.drafter is None:
        _say(f"no DFlash drafter is known for {req.target}: pass --drafter REPO, or train one with `dflash train`")
    if req.preset:
        _say(f"run it: dflash chat --model {req.preset}")
    elif req.drafter:
        _say(f"run it: dflash chat --target {req.target} --drafter {req.drafter}")
    print(f"target\t{got.target_dir}")
    if got.drafter_dir is not None:
        print(f"drafter\t{got.drafter_dir}")
