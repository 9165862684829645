"""Shared CLI plumbing: options, environment, prompt input, error reporting.

Only the CLI reads environment variables:
  DFLASH_HOME      dflash's data root (default: the platform user cache dir, e.g. ~/.cache/dflash)
  DFLASH_DEBUG=1   show full tracebacks instead of one-line errors
  HF_HUB_OFFLINE=1 never use the network (same as --offline); HF_HOME / HF_TOKEN as in huggingface_hub
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from runtime import LoadOptions, ModelRef, Pipeline, RuntimeConfig
    from runtime.backend import Backend
    from runtime.client.remote import RemoteBackend


class DecoderChoice(str, Enum):
    """--decoder values."""

    dflash = "dflash"
    ar = "ar"


class DeviceChoice(str, Enum):
    """--device values."""

    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"
    mps = "mps"


class DtypeChoice(str, Enum):
    """--dtype values."""

    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class ColorChoice(str, Enum):
    """--color values."""

    auto = "auto"
    always = "always"
    never = "never"


# -- option types shared by run / chat / bench / serve -------------------------------------------
ModelOpt = Annotated[str | None, typer.Option("--model", "-m", help="Preset pair (see `dflash models --presets`).")]
TargetOpt = Annotated[str | None, typer.Option("--target", help="Target: Hub id or local folder.")]
DrafterOpt = Annotated[
    str | None, typer.Option("--drafter", help="DFlash drafter: Hub id or local folder ('none': no drafter).")
]
DeviceOpt = Annotated[str, typer.Option("--device", help="auto, cpu, cuda, cuda:N or mps.")]
DtypeOpt = Annotated[DtypeChoice, typer.Option("--dtype", help="auto picks bf16 on CUDA/modern CPUs, fp16 on MPS.")]
OfflineOpt = Annotated[bool, typer.Option("--offline", help="Never use the network (also HF_HUB_OFFLINE=1).")]
RevisionOpt = Annotated[str | None, typer.Option("--revision", help="Hub revision (branch, tag, commit).")]
QuantizeOpt = Annotated[
    str | None,
    typer.Option(
        "--quantize", help="Quantize the target at load time: int8, int4 (torchao), bnb-int8, bnb-nf4 (CUDA)."
    ),
]
ThreadsOpt = Annotated[int | None, typer.Option("--threads", help="CPU threads for torch.")]
MaxTokensOpt = Annotated[int, typer.Option("--max-tokens", "-n", help="Maximum new tokens.")]
TemperatureOpt = Annotated[float, typer.Option("--temperature", "-t", help="0 = greedy.")]
TopPOpt = Annotated[float | None, typer.Option("--top-p", help="Nucleus sampling threshold.")]
TopKOpt = Annotated[int | None, typer.Option("--top-k", help="Keep the k most likely tokens.")]
SeedOpt = Annotated[int, typer.Option("--seed", help="Sampling seed.")]
BlockSizeOpt = Annotated[
    int | None, typer.Option("--block-size", "-b", help="Drafter block size (1 = plain decoding).")
]
VerifyOpt = Annotated[
    int | None, typer.Option("--verify-length", help="Drafts verified per step (default: chosen for the device).")
]
TreeBudgetOpt = Annotated[
    int | None,
    typer.Option(
        "--tree-budget",
        help="Tree verification (DDTree): drafted nodes verified per step; 0 = the chain "
        "(default: chosen for the device from measured costs).",
    ),
]
DecoderOpt = Annotated[DecoderChoice, typer.Option("--decoder", help="dflash (speculative) or ar (plain).")]
ServerOpt = Annotated[
    str | None,
    typer.Option(
        "--server",
        help="Use an OpenAI-compatible server (dflash serve, vLLM, SGLang) instead of local models; "
        "API key from DFLASH_API_KEY or OPENAI_API_KEY.",
    ),
]

# API key of --server, first one set wins.
API_KEY_ENV = ("DFLASH_API_KEY", "OPENAI_API_KEY")


def debug_enabled() -> bool:
    """True when DFLASH_DEBUG asks for tracebacks."""
    return os.environ.get("DFLASH_DEBUG", "").lower() not in ("", "0", "false", "no")


def data_home() -> Path:
    """dflash's data root: $DFLASH_HOME or the platform user cache dir."""
    env = os.environ.get("DFLASH_HOME")
    if env:
        return Path(env).expanduser()
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("dflash", appauthor=False))


def models_dir() -> Path:
    """Where dflash keeps models it converts (the embedded target)."""
    return data_home() / "models"


def state_dir() -> Path:
    """Where dflash keeps its databases (chat sessions, bench runs, history)."""
    env = os.environ.get("DFLASH_HOME")
    if env:
        return Path(env).expanduser() / "state"
    from platformdirs import user_data_dir

    return Path(user_data_dir("dflash", appauthor=False))


def usage_log_path() -> Path:
    """The JSON file where dflash remembers when each model was last used (see `dflash models`)."""
    return state_dir() / "models-usage.json"


def remember_use(pipe: Pipeline, preset: str | None = None) -> None:
    """Note that a pipeline's models were just used (best effort: never fails a command)."""
    from runtime.models.store import UsageLog

    pair = getattr(pipe, "pair", None)
    if pair is None:
        return
    try:
        UsageLog(usage_log_path()).record(
            [pair.target_dir, pair.drafter_dir],
            pair=(pair.target_dir, pair.drafter_dir) if pair.drafter_dir else None,
            pair_name=preset,
        )
    except OSError:
        pass


def env_offline() -> bool:
    """True when HF_HUB_OFFLINE is set to a true value."""
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def model_ref(model: str | None, target: str | None, drafter: str | None) -> ModelRef:
    """Build the runtime's ``ModelRef`` from the shared options."""
    from runtime import ModelRef

    return ModelRef(preset=model, target=target, drafter=drafter)


def runtime_config(device: str, dtype: DtypeChoice | str, threads: int | None = None) -> RuntimeConfig:
    """Build the runtime's ``RuntimeConfig``."""
    from runtime import RuntimeConfig

    return RuntimeConfig(device=device, dtype=dtype.value if isinstance(dtype, Enum) else dtype, threads=threads)


def load_options(offline: bool = False, revision: str | None = None, quantize: str | None = None) -> LoadOptions:
    """Build the runtime's ``LoadOptions`` from flags and the environment."""
    from runtime import LoadOptions

    hf_cache = os.environ.get("HF_HUB_CACHE")
    return LoadOptions(
        models_dir=models_dir(),
        hf_cache_dir=Path(hf_cache) if hf_cache else None,
        offline=offline or env_offline(),
        revision=revision,
        token=os.environ.get("HF_TOKEN"),
        quantize=quantize,
    )


def status(message: str) -> None:
    """A one-line progress message on stderr (only when stderr is a terminal)."""
    if sys.stderr.isatty():
        sys.stderr.write(f"\x1b[2m{message}\x1b[0m\n")
        sys.stderr.flush()


def load(
    model: str | None,
    target: str | None,
    drafter: str | None,
    device: str,
    dtype: DtypeChoice | str,
    offline: bool = False,
    revision: str | None = None,
    quantize: str | None = None,
    threads: int | None = None,
) -> Pipeline:
    """Load a pipeline from the shared options (the CLI's one call into loading)."""
    from transformers.utils import logging as hf_logging

    from runtime import load_pipeline

    hf_logging.disable_progress_bar()  # transformers' per-tensor "Loading weights" bar

    pipe = load_pipeline(
        model_ref(model, target, drafter),
        runtime_config(device, dtype, threads),
        load_options(offline, revision, quantize),
        progress=status,
    )
    remember_use(pipe, model)
    calibrate(pipe)
    return pipe


def calibrate(pipe: Pipeline, say: Callable[[str], None] | None = None) -> None:
    """Give the pipeline this machine's measured verify costs (once per model/device/dtype/threads,
    cached in DFLASH_HOME/calibration.json) so that the runtime picks the verify length and the tree
    budget from them (verifies up to ``TREE_VERIFY_TOKENS`` tokens are timed for trees). GPUs verify
    a whole block or tree for about the cost of one token and skip this."""
    if pipe.drafter is None or pipe.device.type == "cuda":
        return
    from runtime.engine.calibrate import TREE_VERIFY_TOKENS, cache_key, cached_costs

    cache_file = data_home() / "calibration.json"
    known = cache_file.exists() and cache_key(pipe) in cache_file.read_text()
    if not known:
        (say or status)("measuring the verify cost on this machine once (a few seconds)")
    pipe.costs = cached_costs(pipe, cache_file, max_tokens=TREE_VERIFY_TOKENS)


def api_key_from_env() -> str | None:
    """The API key for --server: $DFLASH_API_KEY, else $OPENAI_API_KEY."""
    for name in API_KEY_ENV:
        value = os.environ.get(name, "").strip()
        if value:
            return value
    return None


def remote_backend(server: str, model: str | None = None) -> RemoteBackend:
    """A backend on an OpenAI-compatible server (``--server URL``).

    ``model`` picks one of the server's models; a preset name also matches its target id (so
    ``--model qwen3-8b`` finds ``Qwen/Qwen3-8B`` on vLLM). None: the server's first model.
    """
    from runtime.client.remote import RemoteBackend
    from runtime.models import presets

    backend = RemoteBackend(server, api_key=api_key_from_env(), model=model)
    if model and model.lower() in presets.PRESETS:
        served = backend.info().models
        target = presets.PRESETS[model.lower()].target
        if model not in served and target in served:
            backend = RemoteBackend(server, api_key=backend.api_key, model=target)
    return backend


def make_backend(
    server: str | None,
    model: str | None,
    target: str | None,
    drafter: str | None,
    device: str,
    dtype: DtypeChoice | str,
    offline: bool = False,
    revision: str | None = None,
    quantize: str | None = None,
    threads: int | None = None,
) -> Backend:
    """What run, chat and bench generate with: a remote server when ``server`` is set (``--server``),
    else the local pair loaded from the shared options.

    Both implement ``runtime.backend.Backend`` (``describe``, ``stream_prompt``,
    ``stream_messages``); the remote one also has ``stream_ids`` and ``per_token_status``.

    Raises:
        typer.BadParameter: --server together with --target/--drafter (the server has its models).
    """
    if server:
        if target or drafter:
            raise typer.BadParameter("--server excludes --target/--drafter: the server decides the models")
        return remote_backend(server, model)
    return load(model, target, drafter, device, dtype, offline, revision, quantize, threads)


def read_prompt(argument: str | None) -> str:
    """The prompt: the argument, ``-`` for stdin, or stdin when it is not a TTY.

    Argument and piped stdin are joined (stdin first, then a newline, then the argument), so
    ``cat foo.py | dflash run "add type hints"`` sends the file followed by the instruction.
    """
    piped = ""
    if argument == "-" or not sys.stdin.isatty():
        piped = sys.stdin.read()
    if argument == "-":
        return piped
    if argument and piped:
        return piped.rstrip("\n") + "\n\n" + argument
    return argument if argument is not None else piped


def parse_ids(text: str) -> list[int]:
    """Parse ``1,2,3`` (or space separated) into ints.

    Raises:
        typer.BadParameter: not a list of non-negative integers.
    """
    parts = [p for p in text.replace(",", " ").split() if p]
    try:
        ids = [int(p) for p in parts]
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated token ids, got {text!r}") from None
    if not ids or any(i < 0 for i in ids):
        raise typer.BadParameter(f"expected non-negative token ids, got {text!r}")
    return ids
