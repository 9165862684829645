"""The decode loop (``decode.SpeculativeDecoder``) behind one protocol (``Decoder.stream``)."""

from runtime.engine.decode import SpeculativeDecoder
from runtime.engine.decoder import CancelToken, Decoder, StatsRecorder
from runtime.engine.draft_head import DraftHead
from runtime.engine.select import chain_decoder, plain_decoder, select_decoder, tree_decoder

__all__ = [
    "CancelToken",
    "Decoder",
    "DraftHead",
    "SpeculativeDecoder",
    "StatsRecorder",
    "chain_decoder",
    "plain_decoder",
    "select_decoder",
    "tree_decoder",
]
