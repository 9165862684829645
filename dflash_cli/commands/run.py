"""`dflash run`: one completion for shell pipelines.

stdout carries only the generated text (or NDJSON events with --json); everything else goes to
stderr. Ctrl-C stops after the current verify step, keeps the partial text and exits 130.
"""

from __future__ import annotations

import json
import signal
import sys
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ..common import (
    BlockSizeOpt,
    ColorChoice,
    CompileOpt,
    ConfidenceCutOpt,
    DecoderChoice,
    DecoderOpt,
    DeviceOpt,
    DrafterOpt,
    DtypeChoice,
    DtypeOpt,
    EngineOpt,
    LookupOpt,
    MaxTokensOpt,
    ModelOpt,
    OfflineOpt,
    QuantizeOpt,
    RevisionOpt,
    SeedOpt,
    ServerOpt,
    TargetOpt,
    TemperatureOpt,
    ThreadsOpt,
    TopKOpt,
    TopPOpt,
    TreeBudgetOpt,
    VerifyOpt,
    open_backend,
    parse_ids,
    read_prompt,
    session_options,
)
from ..common import (
    confidence_cut as confidence_cut_setting,
)
from ..errors import handle_errors
from ..render import format_stats_line, paint, warn_block_size

if TYPE_CHECKING:
    from runtime import CancelToken

INTERRUPTED = 130


class _SigintCancel:
    """First Ctrl-C: cancel after the current step; second: raise KeyboardInterrupt at once."""

    def __init__(self, cancel: CancelToken) -> None:
        self.cancel = cancel
        self.previous: Any = None

    def __enter__(self) -> _SigintCancel:
        try:
            self.previous = signal.signal(signal.SIGINT, self._handler)
        except ValueError:  # not in the main thread (e.g. some test runners)
            self.previous = None
        return self

    def _handler(self, _sig: int, _frame: Any) -> None:
        if self.cancel.cancelled:
            raise KeyboardInterrupt
        self.cancel.cancel()

    def __exit__(self, *exc: object) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)


def _read_suffix(value: str) -> str:
    """``--suffix`` as text: ``@path`` reads the file (UTF-8).

    Raises:
        InputError: the file is missing, unreadable or not UTF-8.
    """
    from pathlib import Path

    from runtime import InputError
    from runtime.textio import check_text, decode_utf8

    if not value.startswith("@"):
        return check_text(value, "--suffix")
    path = Path(value[1:]).expanduser()
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise InputError(f"--suffix file {path} does not exist") from None
    except OSError as e:
        raise InputError(f"cannot read the --suffix file {path}: {e.strerror or e}") from None
    return decode_utf8(data, str(path))


@handle_errors
def run(
    prompt: Annotated[
        str | None, typer.Argument(help="Prompt text; '-' reads stdin; piped stdin is prepended.")
    ] = None,
    model: ModelOpt = None,
    target: TargetOpt = None,
    drafter: DrafterOpt = None,
    max_tokens: MaxTokensOpt = 256,
    temperature: TemperatureOpt = 0.0,
    top_p: TopPOpt = None,
    top_k: TopKOpt = None,
    seed: SeedOpt = 0,
    block_size: BlockSizeOpt = None,
    verify_length: VerifyOpt = None,
    tree_budget: TreeBudgetOpt = None,
    lookup: LookupOpt = None,
    confidence_cut: ConfidenceCutOpt = None,
    decoder: DecoderOpt = DecoderChoice.dflash,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = DtypeChoice.auto,
    prompt_ids: Annotated[
        str | None, typer.Option("--prompt-ids", help="Token ids instead of text, e.g. 1,2,3 (no tokenizer needed).")
    ] = None,
    raw: Annotated[bool, typer.Option("--raw", help="Plain completion: no chat template.")] = False,
    chat: Annotated[bool, typer.Option("--chat", help="Force the chat template.")] = False,
    system: Annotated[str | None, typer.Option("--system", "-s", help="System prompt (chat mode).")] = None,
    suffix: Annotated[
        str | None,
        typer.Option(
            "--suffix",
            help="Fill in the middle: the text after the hole (TEXT, or @FILE to read a file); the prompt "
            "(or stdin) is the text before it. Needs a target whose tokenizer has FIM tokens.",
        ),
    ] = None,
    stop: Annotated[list[str] | None, typer.Option("--stop", help="Stop string (repeatable).")] = None,
    stats: Annotated[bool, typer.Option("--stats", help="Print a one-line summary to stderr.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Write the event stream as NDJSON on stdout.")] = False,
    color: Annotated[
        ColorChoice, typer.Option("--color", help="Colour accepted drafts on a terminal.")
    ] = ColorChoice.auto,
    offline: OfflineOpt = False,
    revision: RevisionOpt = None,
    quantize: QuantizeOpt = None,
    threads: ThreadsOpt = None,
    engine: EngineOpt = None,
    compile_mode: CompileOpt = None,
    server: ServerOpt = None,
) -> None:
    """Complete a prompt and stream the text to stdout (for pipes and scripts)."""
    from runtime import CancelToken, DecodeOptions, InputError, SamplingParams, event_to_json

    if raw and chat:
        raise typer.BadParameter("--raw and --chat exclude each other")
    suffix_text = None
    if suffix is not None:
        for flag, given in (("--chat", chat), ("--system", system is not None), ("--prompt-ids", prompt_ids)):
            if given:
                raise typer.BadParameter(f"--suffix (fill in the middle) and {flag} exclude each other")
        if server:
            raise typer.BadParameter(
                "--suffix builds the prompt from the local target's FIM tokens; with --server, post to the "
                "server's /infill (or /v1/completions with suffix) instead"
            )
        suffix_text = _read_suffix(suffix)
    ids = parse_ids(prompt_ids) if prompt_ids else None
    text = None
    if ids is None:
        text = read_prompt(prompt)
        if not text.strip() and suffix_text is None:  # a middle may start at the top of a file
            raise InputError("the prompt is empty; pass text as an argument, '-' or on stdin")
    params = SamplingParams(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        max_new_tokens=max_tokens,
        stop_strings=tuple(stop or ()),
    )
    opts = DecodeOptions(
        decoder=decoder.value,
        block_size=block_size,
        verify_length=verify_length,
        tree_budget=tree_budget,
        lookup=lookup,
        confidence_cut=confidence_cut_setting(confidence_cut),
    )
    use_chat = False if raw else (True if chat else None)
    cancel = CancelToken()
    # a remote OpenAI-compatible server (--server) or the local pair: same events, same rendering
    backend = open_backend(
        session_options(
            model,
            target,
            drafter,
            device,
            dtype,
            offline,
            revision,
            quantize,
            threads,
            server,
            opts,
            engine,
            compile=compile_mode,
        )
    )
    if not server:
        warn_block_size(backend, block_size)  # above the drafter's trained block: slower, says so on stderr
    show_ids = not backend.capabilities.tokenizer  # a pair without a tokenizer: ids in, ids out
    if suffix_text is not None:
        from dataclasses import replace

        from runtime import fim

        name = str(backend.describe().get("target") or "this target")
        built = fim.build(getattr(backend, "tokenizer", None), text or "", suffix_text, target_name=name)
        params = replace(params, stop_token_ids=tuple(sorted(set(params.stop_token_ids) | set(built.stop_ids))))
        events = backend.stream_ids(built.ids, params, opts, cancel)
    else:
        prompt_in: str | list[int] = ids if ids is not None else (text or "")
        events = backend.stream(prompt_in, params, opts, cancel, chat=use_chat, system=system)
    use_color = color == ColorChoice.always or (color == ColorChoice.auto and sys.stdout.isatty())
    out = sys.stdout
    finished = None
    with _SigintCancel(cancel):
        for event in events:
            if json_out:
                out.write(json.dumps(event_to_json(event), ensure_ascii=False) + "\n")
                out.flush()
            elif event.type == "done":
                pass
            else:
                for tok in event.tokens:
                    piece = f"{tok.token_id} " if show_ids else tok.text
                    out.write(paint(piece, tok.status.value) if use_color else piece)
                out.flush()
            if event.type == "done":
                finished = event
    if not json_out and out.isatty():
        out.write("\n")
        out.flush()
    if stats and finished is not None:
        print(format_stats_line(finished.stats, finished.reason), file=sys.stderr, flush=True)
    if finished is not None and finished.reason == "cancelled":
        print("dflash: interrupted", file=sys.stderr, flush=True)
        raise typer.Exit(code=INTERRUPTED)
