"""Shared CLI plumbing: options, environment, prompt input, error reporting.

Only the CLI reads environment variables:
  DFLASH_ENGINE    the target forward: auto (default), lean or hf (same as --engine on run/bench)
  DFLASH_COMPILE   torch.compile the target forward: on/default, reduce-overhead (CUDA graphs), or
                   off/auto (default: eager); same as --compile on run, bench, chat and serve
  DFLASH_HOME      dflash's data root (default: the platform user cache dir, e.g. ~/.cache/dflash)
  DFLASH_DEBUG=1   show full tracebacks instead of one-line errors
  DFLASH_NATIVE=0  do not build or use dflash's native CPU kernels (int8 GEMM; ATen's are used)
  DFLASH_AMX=0     keep dflash's native kernels off AMX tiles (AVX-512/AVX2 paths only)
  DFLASH_KEEP_HEAP=0  leave glibc's mmap/trim thresholds alone (default: raised to 1 GB on CPU loads)
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
    from rich.console import Console

    from runtime import DecodeOptions, LoadOptions, Pipeline
    from runtime.backend import Backend
    from runtime.session import SessionOptions


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
        "--quantize",
        help="Quantize the target at load time: int8, int4 (torchao), q4 (dflash, CPU), bnb-int8, bnb-nf4 (CUDA).",
    ),
]
ThreadsOpt = Annotated[int | None, typer.Option("--threads", help="CPU threads for torch.")]
EngineOpt = Annotated[
    str | None,
    typer.Option(
        "--engine",
        help="Target forward: lean (static KV cache, packed weights; Llama/Qwen2/Qwen3), bucketed (the "
        "capturable step: fixed verify buckets, pooled caches), hf (transformers) or auto (bucketed on CUDA, "
        "lean elsewhere, where supported; also DFLASH_ENGINE).",
    ),
]
CompileOpt = Annotated[
    str | None,
    typer.Option(
        "--compile",
        help="torch.compile the target forward: off (default), default (inductor) or reduce-overhead "
        "(CUDA graphs; the bucketed step); also DFLASH_COMPILE.",
    ),
]
MaxTokensOpt = Annotated[int, typer.Option("--max-tokens", "-n", help="Maximum new tokens.")]
TemperatureOpt = Annotated[float, typer.Option("--temperature", "-t", help="0 = greedy; so is anything below 1e-5.")]
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
LookupOpt = Annotated[
    int | None,
    typer.Option(
        "--lookup",
        help="With tree verification, most tokens per step copied from the prompt or answer where its last "
        "tokens occurred before, verified with the tree; 0 = off (default: 16).",
    ),
]
ConfidenceCutOpt = Annotated[
    bool | None,
    typer.Option(
        "--confidence-cut/--no-confidence-cut",
        help="Size each step's draft tree by the drafter's own confidence, verifying only the nodes worth "
        "their cost (default: on; --no-confidence-cut or DFLASH_CONFIDENCE_CUT=0 verifies the plan).",
    ),
]
CacheSlotsOpt = Annotated[
    int | None,
    typer.Option(
        "--cache-slots",
        min=0,
        help="Contexts the prompt cache keeps (a request reads only what its prompt does not share with "
        "one of them); 0 turns it off (default: 4).",
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


def _switched_off(name: str) -> bool:
    """Whether an on-by-default environment switch is set to 0, false, no or off."""
    return os.environ.get(name, "1").strip().lower() in ("0", "false", "no", "off")


def confidence_cut(flag: bool | None) -> bool:
    """The confidence cut asked for: the flag, else on unless DFLASH_CONFIDENCE_CUT is 0."""
    if flag is not None:
        return flag
    return not _switched_off("DFLASH_CONFIDENCE_CUT")


def configure_kernels() -> None:
    """Native CPU kernels: on unless DFLASH_NATIVE=0, compiled into $DFLASH_HOME/kernels, on AMX
    tiles where the CPU has them unless DFLASH_AMX=0; the heap thresholds raised on CPU loads unless
    DFLASH_KEEP_HEAP=0."""
    from runtime.engine.models import heap, kernels

    kernels.configure(
        enabled=not _switched_off("DFLASH_NATIVE"), cache=data_home() / "kernels", amx=not _switched_off("DFLASH_AMX")
    )
    heap.configure(not _switched_off("DFLASH_KEEP_HEAP"))


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


def console(stderr: bool = False) -> Console:
    """A rich console on stdout or stderr: colours only on a terminal (and as NO_COLOR /
    FORCE_COLOR say), no wrapping, no markup or highlighting of the printed text."""
    from rich.console import Console

    return Console(stderr=stderr, soft_wrap=True, highlight=False, markup=False, emoji=False)


def _stderr() -> Console:
    return console(stderr=True)


def usage_log_path() -> Path:
    """The JSON file where dflash remembers when each model was last used (see `dflash models`)."""
    return state_dir() / "models-usage.json"


def env_offline() -> bool:
    """True when HF_HUB_OFFLINE is set to a true value."""
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def api_key_from_env() -> str | None:
    """The API key for --server: $DFLASH_API_KEY, else $OPENAI_API_KEY."""
    for name in API_KEY_ENV:
        value = os.environ.get(name, "").strip()
        if value:
            return value
    return None


def session_options(
    model: str | None = None,
    target: str | None = None,
    drafter: str | None = None,
    device: str = "auto",
    dtype: DtypeChoice | str = "auto",
    offline: bool = False,
    revision: str | None = None,
    quantize: str | None = None,
    threads: int | None = None,
    server: str | None = None,
    decode: DecodeOptions | None = None,
    engine: str | None = None,
    cache_slots: int | None = None,
    compile: str | None = None,
) -> SessionOptions:
    """The runtime's ``SessionOptions`` from the shared flags and the environment (the one place
    where the CLI turns options into what ``runtime.session.open_backend`` takes).

    Raises:
        typer.BadParameter: --server together with --target/--drafter (the server has its models).
    """
    from runtime import DecodeOptions
    from runtime.session import SessionOptions

    if server and (target or drafter):
        raise typer.BadParameter("--server excludes --target/--drafter: the server decides the models")
    warn_threads(threads)
    configure_kernels()
    hf_cache = os.environ.get("HF_HUB_CACHE")
    return SessionOptions(
        model=model,
        target=target,
        drafter=drafter,
        device=device,
        dtype=dtype.value if isinstance(dtype, Enum) else dtype,
        threads=threads,
        engine=engine or os.environ.get("DFLASH_ENGINE", "auto"),
        compile=compile or os.environ.get("DFLASH_COMPILE", "auto"),
        offline=offline or env_offline(),
        revision=revision,
        quantize=quantize,
        models_dir=models_dir(),
        hf_cache_dir=Path(hf_cache) if hf_cache else None,
        hf_token=os.environ.get("HF_TOKEN"),
        server=server,
        api_key=api_key_from_env() if server else None,
        decode=decode or DecodeOptions(),
        **({"cache_slots": cache_slots} if cache_slots is not None else {}),
        usage_log=usage_log_path(),
        calibration_file=data_home() / "calibration.json",
    )


def cpu_count() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def warn_threads(threads: int | None) -> None:
    """One line on stderr when --threads asks for more threads than there are CPUs (each step then
    waits for threads that share a core: issue 46 measured 3 tok/s against 270 with --threads 999)."""
    cpus = cpu_count()
    if threads is not None and threads > cpus:
        print(
            f"dflash: warning: --threads {threads} is more than the {cpus} CPU(s) here; the extra threads "
            f"slow every step down (try --threads {cpus} or leave it out)",
            file=sys.stderr,
            flush=True,
        )


def load_options(offline: bool = False, revision: str | None = None, quantize: str | None = None) -> LoadOptions:
    """The runtime's ``LoadOptions`` (where models come from) from flags and the environment."""
    return session_options(offline=offline, revision=revision, quantize=quantize).load


def status(message: str) -> None:
    """A one-line progress message on stderr (only when stderr is a terminal)."""
    if sys.stderr.isatty():
        _stderr().print(message, style="dim", markup=False, highlight=False)


def quiet_transformers() -> None:
    """No per-tensor "Loading weights" bar from transformers (the CLI prints its own progress)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def open_backend(opts: SessionOptions, progress: Callable[[str], None] = status) -> Backend:
    """``runtime.session.open_backend`` with the CLI's progress line: a remote server or the local pair."""
    from runtime.session import open_backend as open_

    if not opts.server:
        quiet_transformers()
    return open_(opts, progress)


def open_pipeline(opts: SessionOptions, progress: Callable[[str], None] = status) -> Pipeline:
    """``runtime.session.open_pipeline`` with the CLI's progress line (commands that need the models)."""
    from runtime.session import open_pipeline as open_

    quiet_transformers()
    return open_(opts, progress)


def read_prompt(argument: str | None) -> str:
    """The prompt: the argument, ``-`` for stdin, or stdin when it is not a TTY.

    Argument and piped stdin are joined (stdin first, then a newline, then the argument), so
    ``cat foo.py | dflash run "add type hints"`` sends the file followed by the instruction.

    Raises:
        InputError: stdin or the argument is not valid UTF-8 (the message names the byte offset), or
            stdin is closed (``<&-``) where the prompt has to come from it.
    """
    from runtime.errors import InputError
    from runtime.textio import check_text, decode_utf8

    piped = ""
    if sys.stdin is None:  # closed (`<&-`): no piped text; an error only where the prompt must come from it
        if argument is None or argument == "-":
            raise InputError("stdin is closed and no prompt was given; pass the prompt as an argument or pipe it in")
    elif argument == "-" or not sys.stdin.isatty():
        raw = getattr(sys.stdin, "buffer", None)
        piped = decode_utf8(raw.read(), "stdin") if raw is not None else check_text(sys.stdin.read(), "stdin")
    if argument is not None and argument != "-":
        check_text(argument, "the prompt argument")
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
