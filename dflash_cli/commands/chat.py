"""`dflash chat`: the terminal chat (Textual), showing speculative decoding at work.

Options are those of `dflash run`; the model loads inside the app (with progress), so a load
failure shows there and the app stays usable. With ``--server URL`` the app talks to an
OpenAI-compatible server (dflash serve, vLLM, SGLang) instead of loading a local pair. Sessions
and prompt history live in SQLite under dflash's state directory; `--history` lists them,
`--resume ID|last` opens one.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

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
    session_options,
    state_dir,
)
from ..common import (
    confidence_cut as confidence_cut_setting,
)
from ..errors import handle_errors

if TYPE_CHECKING:
    from runtime import Backend


def chat_db() -> Path:
    """The SQLite file of chat sessions and prompt history."""
    return state_dir() / "chat.sqlite3"


def interactive() -> bool:
    """True when stdin, stdout and stderr are a terminal (Textual draws on stderr)."""
    return all(s is not None and s.isatty() for s in (sys.stdin, sys.stdout, sys.__stderr__))


def _resume_id(value: str, db: Path) -> int:
    from runtime import InputError
    from tui.store import open_store

    store, problem = open_store(db)
    if problem:
        store.close()
        raise InputError(f"cannot resume: {problem}")
    try:
        if value == "last":
            sessions = store.list_sessions(limit=1)
            if not sessions:
                raise InputError("there is no chat session to resume yet; start one with `dflash chat`")
            return sessions[0].id
        if not value.isdigit() or store.get_session(int(value)) is None:
            raise InputError(f"no chat session {value!r}; `dflash chat --history` lists them")
        return int(value)
    finally:
        store.close()


@handle_errors
def chat(
    model: ModelOpt = None,
    target: TargetOpt = None,
    drafter: DrafterOpt = None,
    max_tokens: MaxTokensOpt = 1024,
    temperature: TemperatureOpt = 0.0,
    top_p: TopPOpt = None,
    top_k: TopKOpt = None,
    seed: SeedOpt = 0,
    block_size: BlockSizeOpt = None,
    verify_length: VerifyOpt = None,
    tree_budget: TreeBudgetOpt = None,
    lookup: LookupOpt = None,
    confidence_cut: ConfidenceCutOpt = None,
    cache_slots: CacheSlotsOpt = None,
    decoder: DecoderOpt = DecoderChoice.dflash,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = DtypeChoice.auto,
    system: Annotated[
        str | None, typer.Option("--system", "-s", help="System prompt (F2 edits it in the app).")
    ] = None,
    stop: Annotated[list[str] | None, typer.Option("--stop", help="Stop string (repeatable).")] = None,
    history: Annotated[bool, typer.Option("--history", help="List stored chat sessions and exit.")] = False,
    resume: Annotated[
        str | None, typer.Option("--resume", "-r", help="Open a stored session: its id or 'last'.")
    ] = None,
    no_ghost: Annotated[bool, typer.Option("--no-ghost", help="Start with rejected drafts hidden.")] = False,
    view: Annotated[
        str, typer.Option("--view", help="Finished answers: 'markdown' or 'origin' (coloured by token origin).")
    ] = "markdown",
    offline: OfflineOpt = False,
    revision: RevisionOpt = None,
    quantize: QuantizeOpt = None,
    threads: ThreadsOpt = None,
    compile_mode: CompileOpt = None,
    server: ServerOpt = None,
) -> None:
    """Chat in a full-screen terminal app; tokens are coloured by origin, with live statistics."""
    from runtime import ConfigError, DecodeOptions, SamplingParams

    if server and (target or drafter):
        raise typer.BadParameter("--server excludes --target/--drafter: the server decides the models")

    db = chat_db()
    if history:
        from runtime import InputError
        from tui.store import format_sessions, open_store

        store, problem = open_store(db)
        if problem:
            store.close()
            raise InputError(problem)
        try:
            typer.echo(format_sessions(store.list_sessions(limit=100)))
        finally:
            store.close()
        return
    if view not in ("markdown", "origin"):
        raise typer.BadParameter(f"expected 'markdown' or 'origin', got {view!r}", param_hint="--view")
    params = SamplingParams(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        max_new_tokens=max_tokens,
        stop_strings=tuple(stop or ()),
    )
    # --drafter none means plain decoding: no drafter to draft with.
    plain = decoder == DecoderChoice.ar or (drafter or "").lower() == "none"
    opts = DecodeOptions(
        decoder="ar" if plain else "dflash",
        block_size=block_size,
        verify_length=verify_length,
        tree_budget=tree_budget,
        lookup=lookup,
        confidence_cut=confidence_cut_setting(confidence_cut),
    )
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
        server,
        opts,
        cache_slots=cache_slots,
        compile=compile_mode,
    )
    resume_id = _resume_id(resume, db) if resume is not None else None
    if not interactive():
        raise ConfigError(
            "dflash chat needs an interactive terminal (stdin, stdout and stderr); "
            "in pipes and scripts use `dflash run`"
        )

    def backend_factory(progress: Callable[[str], None]) -> Backend:
        # runs in the app's loading worker: progress and failures show in the app
        return open_backend(session, progress)

    from tui import ChatConfig, make_app

    label = server or target or model or "embedded default pair"
    config = ChatConfig(
        params=params,
        decode=opts,
        system=system,
        db_path=db,
        resume=resume_id,
        show_ghost=not no_ghost,
        view=view,  # type: ignore[arg-type]
        model_label=label,
    )
    make_app(backend_factory, config).run()
