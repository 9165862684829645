"""Training's changes to a drafter's shape: copy inputs added (``add_copy_inputs``) and a corpus
table added (``add_copy_corpus``). Each keeps what the drafter drafted until it is trained (the new
rows start at zero, or as copies of the context's 1-gram row)."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from runtime.engine.models.corpus import CorpusTable, corpus_rows
from runtime.engine.models.drafter import DFlashDraftModel
from runtime.errors import ConfigError


def add_copy_inputs(model: DFlashDraftModel, ngram: tuple[int, int]) -> DFlashDraftModel:
    """Give a drafter copy inputs (``DFlashDraftModel.copy_inputs``) for ``ngram`` context matches.

    The new ``copy_scale`` and ``copy_bias`` start at zero, so the drafter drafts exactly as before
    until trained.
    A drafter that already has copy inputs for the same n-grams is returned unchanged.

    Raises:
        ConfigError: it has copy inputs for other n-gram sizes.
    """
    current = model.dflash.copy_ngram
    if current == tuple(ngram):
        return model
    if current is not None:
        raise ConfigError(f"the drafter has copy inputs for {list(current)}-grams, not {list(ngram)}")
    dflash = replace(model.dflash, copy_ngram=(int(ngram[0]), int(ngram[1])))
    raw = dict(model.config.raw)
    raw["dflash_config"] = {**dict(raw.get("dflash_config") or {}), "copy_ngram": list(dflash.copy_ngram or ())}
    model.config = replace(model.config, dflash=dflash, raw=raw)
    ref = next(model.parameters())
    model.copy_scale = nn.Parameter(
        torch.zeros(ngram[1] + 1, model.config.hidden_size, device=ref.device, dtype=ref.dtype)
    )
    model.copy_bias = nn.Parameter(torch.zeros(ngram[1] + 1, device=ref.device, dtype=ref.dtype))
    return model


def add_copy_corpus(
    model: DFlashDraftModel, ngram: tuple[int, int], table: CorpusTable | None = None
) -> DFlashDraftModel:
    """Give a drafter with copy inputs a corpus table (``runtime.engine.models.corpus``).

    The corpus's new ``copy_scale`` / ``copy_bias`` rows start as copies of the context's 1-gram
    row: a corpus proposal replaces a 1-gram context copy (or nothing) and starts out trusted as
    much as one. A drafter that already has a corpus of the same sizes gets the new table;
    ``table`` None leaves the table to be set later (``Trainer`` builds it from its counts).

    Raises:
        ConfigError: the drafter has no copy inputs, or a corpus of other sizes.
    """
    current = model.dflash.copy_corpus
    if model.dflash.copy_ngram is None or model.copy_scale is None or model.copy_bias is None:
        raise ConfigError("a corpus needs a drafter with copy inputs (--copy-inputs or --copy-ngram)")
    if current is not None and current != tuple(ngram):
        raise ConfigError(f"the drafter has a corpus of {list(current)}-grams, not {list(ngram)}")
    if table is not None:
        model.corpus = table
    if current is not None:
        return model
    dflash = replace(model.dflash, copy_corpus=(int(ngram[0]), int(ngram[1])))
    raw = dict(model.config.raw)
    raw["dflash_config"] = {**dict(raw.get("dflash_config") or {}), "copy_corpus": list(dflash.copy_corpus or ())}
    model.config = replace(model.config, dflash=dflash, raw=raw)
    extra = corpus_rows(dflash.copy_corpus or ngram)
    with torch.no_grad():
        model.copy_scale = nn.Parameter(torch.cat([model.copy_scale, model.copy_scale[1:2].repeat(extra, 1)]))
        model.copy_bias = nn.Parameter(torch.cat([model.copy_bias, model.copy_bias[1:2].repeat(extra)]))
    return model
