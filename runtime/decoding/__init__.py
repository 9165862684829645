"""Decoding loops behind one protocol (``Decoder.stream``)."""

from .base import CancelToken, Decoder, StatsRecorder
from .dflash import AutoregressiveDecoder, DFlashDecoder, DraftHead

__all__ = ["AutoregressiveDecoder", "CancelToken", "DFlashDecoder", "Decoder", "DraftHead", "StatsRecorder"]
