"""`dflash serve`: an OpenAI-compatible server for the local runtime, or the vLLM/SGLang server
command with DFlash speculative decoding configured.

Local engine: binds the port first (a busy port fails before any model loads), loads the pair,
serves one generation at a time with a queue. The API key, when wanted, comes from
$DFLASH_API_KEY. The listening address is printed on stderr as
``dflash: serving MODEL on http://HOST:PORT/v1``.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ..common import (
    BlockSizeOpt,
    CacheSlotsOpt,
    CompileOpt,
    ConfidenceCutOpt,
    DecoderChoice,
    DecoderOpt,
    DeviceOpt,
    DrafterOpt,
    DtypeChoice,
    DtypeOpt,
    LookupOpt,
    ModelOpt,
    OfflineOpt,
    QuantizeOpt,
    RevisionOpt,
    TargetOpt,
    ThreadsOpt,
    TreeBudgetOpt,
    VerifyOpt,
    debug_enabled,
    load_options,
    open_pipeline,
    session_options,
)
from ..common import (
    confidence_cut as confidence_cut_setting,
)
from ..errors import handle_errors
from ..render import warn_block_size

if TYPE_CHECKING:
    from runtime import DecodeOptions, Pipeline
    from runtime.session import SessionOptions

LOOPBACK = ("127.0.0.1", "localhost", "::1")


class EngineChoice(str, Enum):
    """--engine values."""

    local = "local"
    vllm = "vllm"
    sglang = "sglang"


def _bind(host: str, port: int) -> socket.socket:
    from runtime import ConfigError

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)  # clients that connect while the models load wait in the backlog
    except OSError as e:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror or e}; pick another --port") from None
    return sock


def _served_names(model: str | None, target: str | None, pipe: Pipeline, served: str | None) -> tuple[str, ...]:
    from runtime.models import presets

    if served:
        first = served
    elif model:
        first = model.lower()
    elif target:
        first = Path(target).name if Path(target).exists() else target
    else:
        first = presets.EMBEDDED
    names = [first]
    if pipe.pair.target_name not in names and not Path(pipe.pair.target_name).exists():
        names.append(pipe.pair.target_name)
    return tuple(names)


def _log_config(level: str) -> dict[str, Any]:
    """uvicorn's logging, all on stderr (stdout stays empty)."""
    fmt = "%(asctime)s %(levelname)s %(message)s"
    handler = {"class": "logging.StreamHandler", "formatter": "plain", "stream": "ext://sys.stderr"}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"plain": {"format": fmt, "datefmt": "%H:%M:%S"}},
        "handlers": {"stderr": handler},
        "loggers": {
            "uvicorn": {"handlers": ["stderr"], "level": level.upper(), "propagate": False},
            "uvicorn.error": {"level": level.upper()},
            "uvicorn.access": {"handlers": ["stderr"], "level": level.upper(), "propagate": False},
        },
    }


def _run_engine(
    engine: str,
    model: str | None,
    target: str | None,
    drafter: str | None,
    block_size: int | None,
    draft_tokens: int | None,
    tensor_parallel: int,
    host: str,
    port: int,
    served: str | None,
    extra: list[str],
    print_command: bool,
) -> None:
    from runtime import ConfigError

    from ..server import engines

    t, d, thinking = engines.resolve_engine_pair(model, target, drafter)
    hf_cache = load_options().hf_cache_dir
    plan = engines.EnginePlan(
        engine=engine,
        target=t,
        drafter=d,
        block_size=block_size or engines.block_size_of(d, hf_cache),
        draft_tokens=draft_tokens,
        tensor_parallel=tensor_parallel,
        host=host,
        port=port,
        thinking_off=thinking,
        served_name=served,
        extra=tuple(extra),
    )
    if print_command:
        print(engines.shell_line(engines.command(plan)), flush=True)
        return
    launcher = engines.installed_launcher(engine)
    if launcher is None:
        raise ConfigError(
            f"{engine} is not installed here; install it on the GPU machine (pip install {engine}=="
            f"{engines.VERSIONS[engine]}) or print the command with --print-command"
        )
    argv = engines.command(plan, python=launcher)
    if engine == "vllm":
        argv[0] = launcher
    print(f"dflash: starting {engine}: {engines.shell_line(argv)}", file=sys.stderr, flush=True)
    try:
        code = subprocess.call(argv)
    except OSError as e:
        raise ConfigError(f"cannot start {engine}: {e}") from None
    raise typer.Exit(code=code)


@handle_errors
def serve(
    ctx: typer.Context,
    model: ModelOpt = None,
    target: TargetOpt = None,
    drafter: DrafterOpt = None,
    engine: Annotated[
        EngineChoice, typer.Option("--engine", help="local (this runtime), vllm or sglang (their own servers).")
    ] = EngineChoice.local,
    host: Annotated[str, typer.Option("--host", help="Address to listen on (0.0.0.0: every interface).")] = (
        "127.0.0.1"
    ),
    port: Annotated[
        int | None, typer.Option("--port", "-p", help="Port (0: any free one). Default 8000; SGLang 30000.")
    ] = None,
    served_model_name: Annotated[
        str | None,
        typer.Option("--served-model-name", help="Model id clients send (default: the preset or folder name)."),
    ] = None,
    max_tokens_limit: Annotated[
        int, typer.Option("--max-tokens-limit", help="Most new tokens one request may ask for (also the default).")
    ] = 4096,
    max_queue: Annotated[
        int, typer.Option("--max-queue", help="Requests that may wait for the generation slot; more get 503.")
    ] = 16,
    block_size: BlockSizeOpt = None,
    verify_length: VerifyOpt = None,
    tree_budget: TreeBudgetOpt = None,
    lookup: LookupOpt = None,
    confidence_cut: ConfidenceCutOpt = None,
    cache_slots: CacheSlotsOpt = None,
    compile_mode: CompileOpt = None,
    decoder: DecoderOpt = DecoderChoice.dflash,
    draft_tokens: Annotated[
        int | None,
        typer.Option("--draft-tokens", help="vLLM/SGLang: drafts per verify step (default: block size - 1)."),
    ] = None,
    tensor_parallel_size: Annotated[
        int, typer.Option("--tensor-parallel-size", "-tp", help="vLLM/SGLang: GPUs per model replica.")
    ] = 1,
    print_command: Annotated[
        bool, typer.Option("--print-command", help="vLLM/SGLang: print the engine's command instead of running it.")
    ] = False,
    log_level: Annotated[str, typer.Option("--log-level", help="Server log level: warning, info, debug.")] = "info",
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = DtypeChoice.auto,
    offline: OfflineOpt = False,
    revision: RevisionOpt = None,
    quantize: QuantizeOpt = None,
    threads: ThreadsOpt = None,
) -> None:
    """Serve a pair over an OpenAI-compatible HTTP API (or start vLLM/SGLang with DFlash).

    Arguments after `--` go to the vLLM/SGLang command as they are.
    """
    from runtime import ConfigError, DecodeOptions

    from ..server import engines

    port = engines.DEFAULT_PORTS[engine.value] if port is None else port
    if not 0 <= port <= 65535:
        raise ConfigError(f"--port must be in 0..65535, got {port}")
    if engine != EngineChoice.local:
        _run_engine(
            engine.value,
            model,
            target,
            drafter,
            block_size,
            draft_tokens,
            tensor_parallel_size,
            host,
            port,
            served_model_name,
            list(ctx.args),
            print_command,
        )
        return
    if ctx.args:
        raise typer.BadParameter(f"unexpected arguments for the local engine: {' '.join(ctx.args)}")
    if print_command:
        raise typer.BadParameter("--print-command is for --engine vllm or sglang")
    if max_tokens_limit < 1:
        raise ConfigError(f"--max-tokens-limit must be >= 1, got {max_tokens_limit}")
    if max_queue < 0:
        raise ConfigError(f"--max-queue must be >= 0, got {max_queue}")
    opts = DecodeOptions(
        decoder=decoder.value,
        block_size=block_size,
        verify_length=verify_length,
        tree_budget=tree_budget,
        lookup=lookup,
        confidence_cut=confidence_cut_setting(confidence_cut),
    )
    api_key = os.environ.get("DFLASH_API_KEY", "").strip() or None
    session = session_options(
        model,
        target,
        drafter,
        device,
        dtype,
        offline,
        revision,
        quantize,
        threads,
        cache_slots=cache_slots,
        compile=compile_mode,
    )
    sock = _bind(host, port)
    try:
        _serve_local(sock, host, session, served_model_name, max_tokens_limit, max_queue, opts, api_key, log_level)
    finally:
        sock.close()


def _serve_local(
    sock: socket.socket,
    host: str,
    session: SessionOptions,
    served_model_name: str | None,
    max_tokens_limit: int,
    max_queue: int,
    opts: DecodeOptions,
    api_key: str | None,
    log_level: str,
) -> None:
    import uvicorn

    from runtime import DecodeOptions

    from ..server.app import DFlashServer
    from ..server.config import ServeConfig
    from ..server.protocol import Limits

    pipe = open_pipeline(session)
    warn_block_size(pipe, opts.block_size)
    if pipe.drafter is None and opts.decoder == "dflash":
        opts = DecodeOptions(decoder="ar")  # no drafter: plain decoding is all there is
    names = _served_names(session.model, session.target, pipe, served_model_name)
    config = ServeConfig(
        model_names=names,
        limits=Limits(max_tokens=max_tokens_limit),
        max_queue=max_queue,
        api_key=api_key,
        decode=opts,
        debug=debug_enabled(),
    )
    served = DFlashServer(pipe, config)
    app = served.app()
    bound_port = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    print(
        f"dflash: serving {names[0]} on http://{shown}:{bound_port}/v1 "
        f"({pipe.pair.target_name} + {pipe.pair.drafter_name or 'no drafter'}, {pipe.device}, decoder {opts.decoder})",
        file=sys.stderr,
        flush=True,
    )
    if host not in LOOPBACK and not api_key:
        print("dflash: warning: listening beyond this machine without an API key (set DFLASH_API_KEY)", file=sys.stderr)
    server = _quiet_server(
        uvicorn.Config(app, log_config=_log_config(log_level), timeout_graceful_shutdown=3, access_log=True),
        on_exit=served.cancel_all,
    )
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # Ctrl-C is how a server is stopped: uvicorn has shut down cleanly
        pass
    print("dflash: server stopped", file=sys.stderr, flush=True)


def _quiet_server(config: Any, on_exit: Any) -> Any:
    """A uvicorn server that Ctrl-C (or SIGTERM) stops cleanly: exit 0, no traceback.

    uvicorn re-raises every captured signal once it has shut down, and a second Ctrl-C makes it skip
    the app's shutdown, so a second Ctrl-C during shutdown surfaced as KeyboardInterrupt/CancelledError
    tracebacks (request and lifespan tasks) and a non-zero exit. Here the first signal cancels the
    generations (``on_exit``: streams end with finish_reason "abort" at the next step, so the graceful
    shutdown does not wait for them) and starts the shutdown; later signals change nothing.
    """
    import asyncio
    import contextlib
    import signal
    import threading

    import uvicorn

    class QuietServer(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            if self.should_exit:
                return  # already shutting down, within timeout_graceful_shutdown
            self.should_exit = True
            try:  # not from inside the signal handler: it may have interrupted a lock holder
                asyncio.get_running_loop().call_soon_threadsafe(on_exit)
            except RuntimeError:
                on_exit()

        @contextlib.contextmanager
        def capture_signals(self) -> Any:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, self.handle_exit)
            try:
                yield
            finally:  # the process is exiting: later signals change nothing (uvicorn would re-raise them)
                for sig in (signal.SIGINT, signal.SIGTERM):
                    signal.signal(sig, signal.SIG_IGN)

    return QuietServer(config)
