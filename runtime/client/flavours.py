"""What each kind of OpenAI-compatible server exposes beyond text, and how it is read: the
flavour from ``/v1/models`` (``ServerInfo``), and speculative-decoding statistics from vLLM's
per-request metrics or ``/metrics`` counters, SGLang's spec details, llama.cpp's ``timings``;
``GenerationStats`` built from them (``remote_stats``, ``llamacpp_stats``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from runtime.engine.acceptance import AcceptanceCounts
from runtime.engine.events import GenerationStats

FLAVOURS = ("dflash", "vllm", "sglang", "openai")
VLLM_COUNTERS = (
    "vllm:spec_decode_num_drafts_total",
    "vllm:spec_decode_num_draft_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_total",
)
VLLM_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"


@dataclass(frozen=True)
class ServerInfo:
    """What ``/v1/models`` said.

    Attributes:
        flavour: "dflash", "vllm", "sglang" or "openai" (anything else).
        models: served model ids, in the server's order.
        details: dflash serve's description of its pipeline (empty for other servers).
    """

    flavour: str
    models: tuple[str, ...]
    details: dict[str, Any]


def server_info(doc: Any, url: str) -> ServerInfo:
    """Read ``/v1/models``'s document: served models, the flavour (``owned_by`` of the first), and
    dflash serve's description of its pipeline.

    Raises:
        ValueError: the document has no model list (the caller names the server).
    """
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, list):
        raise ValueError(f"{url}/v1/models has no model list: is it an OpenAI-compatible server?")
    models = tuple(str(m.get("id")) for m in data if isinstance(m, dict) and m.get("id"))
    owner = str(data[0].get("owned_by", "")).lower() if data and isinstance(data[0], dict) else ""
    flavour = owner if owner in FLAVOURS else "openai"
    details = data[0].get("dflash", {}) if flavour == "dflash" and isinstance(data[0], dict) else {}
    return ServerInfo(flavour, models, dict(details or {}))


@dataclass(frozen=True)
class Spec:
    """Speculative-decoding counts a server reported for one request."""

    counts: AcceptanceCounts
    draft_len: int = 0  # drafts per verify step (0: unknown)


def spec_from_vllm(m: dict[str, Any]) -> Spec | None:
    try:
        counts = AcceptanceCounts.from_totals(
            int(m["num_spec_steps"]),
            int(m["num_draft_tokens"]),
            int(m["num_accepted_draft_tokens"]),
            m.get("acceptance_histogram") or (),
        )
        return Spec(counts, draft_len=int(m.get("num_spec_tokens") or 0))
    except (KeyError, TypeError, ValueError):
        return None


def spec_from_llamacpp(t: dict[str, Any], generated: int) -> Spec | None:
    """llama.cpp's ``timings`` (``draft_n``, ``draft_n_accepted``): it reports no step count, but each
    verify step commits its accepted drafts plus one token, so steps = generated - accepted."""
    try:
        drafted, accepted = int(t.get("draft_n") or 0), int(t.get("draft_n_accepted") or 0)
    except (TypeError, ValueError):
        return None
    if drafted <= 0:
        return None
    steps = max(generated - 1 - accepted, 1)  # the first token comes from the prompt pass
    return Spec(AcceptanceCounts.from_totals(steps, drafted, accepted))


def spec_from_sglang(d: dict[str, Any]) -> Spec | None:
    steps = int(d.get("spec_verify_ct") or 0)
    if steps <= 0:
        return None
    drafted = int(d.get("spec_num_proposed_drafts") or 0)
    counts = AcceptanceCounts.from_totals(
        steps, drafted, int(d.get("spec_num_correct_drafts") or 0), d.get("spec_correct_drafts_histogram") or ()
    )
    return Spec(counts, draft_len=drafted // steps if drafted else 0)


def parse_prometheus(text: str, names: Sequence[str]) -> dict[str, float]:
    """Sum the samples of the named metrics over all label sets (``prometheus_client``'s parser;
    the ``position`` label is kept as ``name[pos]``, used by vLLM's per-position counter).
    Text the parser rejects ends the reading (what was read before it is kept)."""
    out: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name not in names:
                    continue
                pos = sample.labels.get("position")
                key = sample.name if pos is None else f"{sample.name}[{pos}]"
                out[key] = out.get(key, 0.0) + float(sample.value)
    except ValueError:
        pass
    return out


def spec_from_counter_delta(before: dict[str, float], after: dict[str, float]) -> Spec | None:
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    steps = int(d.get(VLLM_COUNTERS[0], 0))
    if steps <= 0:
        return None
    per_pos = []
    i = 0
    while f"{VLLM_PER_POS}[{i}]" in d:
        per_pos.append(int(d[f"{VLLM_PER_POS}[{i}]"]))
        i += 1
    drafted = int(d.get(VLLM_COUNTERS[1], 0))
    counts = AcceptanceCounts.from_totals(steps, drafted, int(d.get(VLLM_COUNTERS[2], 0)), slot_accepted=per_pos)
    return Spec(counts, draft_len=drafted // steps)


def llamacpp_stats(usage: dict[str, Any], generated: int, t: dict[str, Any]) -> GenerationStats:
    """Statistics from llama.cpp's own ``timings``: prompt and decode times measured in the server
    (``prompt_ms``, ``predicted_ms``; decode tok/s = ``predicted_per_second``), drafts and accepted
    drafts of its speculative modes. ``decoder`` is "llama.cpp" so that bench uses these times."""
    prompt_s = float(t.get("prompt_ms") or 0.0) / 1000
    decode_s = float(t.get("predicted_ms") or 0.0) / 1000
    n = int(t.get("predicted_n") or generated)
    spec = spec_from_llamacpp(t, n)
    return GenerationStats(
        prompt_tokens=int(t.get("prompt_n") or usage.get("prompt_tokens") or 0),
        generated_tokens=n,
        ttft_seconds=prompt_s,
        total_seconds=prompt_s + decode_s,
        tokens_per_second=n / max(prompt_s + decode_s, 1e-9),
        decode_tokens_per_second=float(t.get("predicted_per_second") or n / max(decode_s, 1e-9)),
        acceptance=spec.counts if spec is not None else AcceptanceCounts(),
        block_size=1,
        verify_length=0,
        decoder="llama.cpp",
    )


def remote_stats(
    usage: dict[str, Any], generated: int, ttft: float, total: float, spec: Spec | None
) -> GenerationStats:
    decode_time = max(total - ttft, 1e-9)
    return GenerationStats(
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        generated_tokens=generated,
        ttft_seconds=ttft,
        total_seconds=total,
        tokens_per_second=generated / max(total, 1e-9),
        decode_tokens_per_second=max(generated - 1, 0) / decode_time,
        acceptance=spec.counts if spec is not None else AcceptanceCounts(),
        block_size=(spec.draft_len + 1 if spec.draft_len else 0) if spec is not None else 1,
        verify_length=spec.draft_len if spec is not None else 0,
        decoder="dflash" if spec is not None else "remote",
    )
