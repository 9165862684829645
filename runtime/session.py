"""From parsed options to a ready backend, in one call.

``open_backend(SessionOptions(...))`` is what every command does between "options parsed" and
"ready to generate": a remote server when ``server`` is set, else resolve the pair (preset, Hub,
folder or embedded), load it, remember its use (``dflash models``) and give it this machine's
measured verify costs (the verify length is chosen from them). ``open_pipeline`` is the local half,
for commands that need the loaded models themselves (bench, serve, train).

The options arrive filled in by the caller (the CLI reads flags and environment variables);
nothing here reads the environment.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from runtime.backend import Backend
from runtime.client.remote import RemoteBackend
from runtime.config import DecodeOptions, RuntimeConfig
from runtime.engine.prompt_cache import DEFAULT_SLOTS, PromptCache
from runtime.errors import ConfigError
from runtime.pipeline import LoadOptions, ModelRef, Pipeline, load_pipeline

Progress = Callable[[str], None]


@dataclass(frozen=True)
class SessionOptions:
    """Everything needed to build a backend.

    Attributes:
        model, target, drafter: what the user named (see ``ModelRef``; all None: the embedded pair).
        device, dtype, threads, engine, compile: where and with which target forward the models run (see
            ``RuntimeConfig``).
        offline, revision, quantize: how models are found and loaded (see ``LoadOptions``).
        models_dir: dflash's own model folder (the embedded target is converted there).
        hf_cache_dir, hf_token: Hugging Face cache folder and token (None: huggingface_hub's defaults).
        server: an OpenAI-compatible server to use instead of local models.
        api_key: the key sent to ``server``.
        decode: the decode options requests will use (checked against a remote server up front).
        usage_log: JSON file where model use is remembered (None: not remembered).
        calibration_file: JSON file caching measured verify costs (None: not calibrated).
        cache_slots: contexts the prompt cache keeps (``runtime.engine.prompt_cache``; 0: no cache).
    """

    model: str | None = None
    target: str | None = None
    drafter: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    threads: int | None = None
    engine: str = "auto"
    compile: str = "auto"
    offline: bool = False
    revision: str | None = None
    quantize: str | None = None
    models_dir: Path = field(default_factory=lambda: LoadOptions().models_dir)
    hf_cache_dir: Path | None = None
    hf_token: str | None = None
    server: str | None = None
    api_key: str | None = None
    decode: DecodeOptions = field(default_factory=DecodeOptions)
    usage_log: Path | None = None
    calibration_file: Path | None = None
    cache_slots: int = DEFAULT_SLOTS

    def __post_init__(self) -> None:
        if self.cache_slots < 0:
            raise ConfigError(f"--cache-slots must be >= 0 (0 = no prompt cache), got {self.cache_slots}")
        if self.server and (self.target or self.drafter):
            raise ConfigError("--server excludes --target/--drafter: the server decides the models")
        _ = self.runtime  # device, dtype and threads are checked now, before anything loads

    @property
    def ref(self) -> ModelRef:
        """What to load."""
        return ModelRef(preset=self.model, target=self.target, drafter=self.drafter)

    @property
    def runtime(self) -> RuntimeConfig:
        """Device, dtype and threads."""
        return RuntimeConfig(
            device=self.device, dtype=self.dtype, threads=self.threads, engine=self.engine, compile=self.compile
        )

    @property
    def load(self) -> LoadOptions:
        """Where models come from."""
        return LoadOptions(
            models_dir=self.models_dir,
            hf_cache_dir=self.hf_cache_dir,
            offline=self.offline,
            revision=self.revision,
            token=self.hf_token,
            quantize=self.quantize,
        )


def open_backend(opts: SessionOptions, progress: Progress | None = None) -> Backend:
    """A remote backend when ``opts.server`` is set, else the local pair (``open_pipeline``).

    Raises:
        DFlashError: the server cannot be reached or refuses the options; see ``open_pipeline``.
    """
    if opts.server:
        return open_remote(opts, progress)
    return open_pipeline(opts, progress)


def open_remote(opts: SessionOptions, progress: Progress | None = None) -> RemoteBackend:
    """The backend of an OpenAI-compatible server, checked once (its models, the decode options).

    ``opts.model`` picks one of the server's models; a preset name also matches its target id (so
    ``--model qwen3-8b`` finds ``Qwen/Qwen3-8B`` on vLLM). None: the server's first model.

    Raises:
        ConfigError: no server named, or decode options the server cannot take per request.
        RemoteError: the server cannot be reached.
    """
    from runtime.models import presets

    if not opts.server:
        raise ConfigError("no server URL given")
    if progress:
        progress(f"connecting to {opts.server}")
    backend = RemoteBackend(opts.server, api_key=opts.api_key, model=opts.model)
    model = opts.model
    if model and model.lower() in presets.PRESETS:
        served = backend.info().models
        target = presets.PRESETS[model.lower()].target
        if model not in served and target in served:
            backend = RemoteBackend(opts.server, api_key=opts.api_key, model=target)
    backend.check_decode_options(opts.decode)
    if progress:
        progress(f"{backend.model} on {backend.url} ({backend.flavour})")
    return backend


def open_pipeline(opts: SessionOptions, progress: Progress | None = None) -> Pipeline:
    """Resolve, check and load the local pair, remember its use and calibrate it.

    Raises:
        ModelNotFoundError, ModelLoadError, IncompatibleDraftError, ConfigError: see ``load_pipeline``.
    """
    pipe = load_pipeline(opts.ref, opts.runtime, opts.load, progress=progress)
    pipe.prompt_cache = PromptCache(opts.cache_slots) if opts.cache_slots else None
    if opts.usage_log is not None:
        remember_use(pipe, opts.usage_log, opts.model)
    if opts.calibration_file is not None:
        calibrate(pipe, opts.calibration_file, progress)
    return pipe


def remember_use(pipe: Pipeline, usage_log: Path, preset: str | None = None) -> None:
    """Note that a pipeline's models were just used (best effort: never fails a command)."""
    from runtime.models.store import UsageLog

    pair = pipe.pair
    try:
        UsageLog(usage_log).record(
            [pair.target_dir, pair.drafter_dir],
            pair=(pair.target_dir, pair.drafter_dir) if pair.drafter_dir else None,
            pair_name=preset,
        )
    except OSError:
        pass


def calibrate(pipe: Pipeline, cache_file: Path, progress: Progress | None = None) -> None:
    """Give the pipeline this machine's measured verify costs (measured once per
    model/device/dtype/threads, cached in ``cache_file``) so that the runtime picks the verify
    length and the tree budget from them, on every device (a GPU's costs are measured too, chains and
    masked trees, not assumed flat)."""
    if pipe.drafter is None:
        return
    from runtime.engine.calibrate import TREE_VERIFY_TOKENS, cache_key, cached_costs, read_costs

    known = cache_key(pipe) in read_costs(cache_file)[0]
    if not known and progress:
        progress("measuring the verify cost on this machine once (a few seconds)")
    # verifies up to TREE_VERIFY_TOKENS tokens are timed too: the tree budget is chosen from them
    pipe.costs = cached_costs(pipe, cache_file, max_tokens=TREE_VERIFY_TOKENS)
