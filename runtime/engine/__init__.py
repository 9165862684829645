"""Decoding loops behind one protocol (``Decoder.stream``)."""

from runtime.engine.decoder import CancelToken, Decoder, StatsRecorder
from runtime.engine.dflash import AutoregressiveDecoder, DFlashDecoder, DraftHead
from runtime.engine.tree_decoder import TreeDecoder

__all__ = [
    "AutoregressiveDecoder",
    "CancelToken",
    "DFlashDecoder",
    "Decoder",
    "DraftHead",
    "StatsRecorder",
    "TreeDecoder",
]
