"""The native decoder-layer stack's ctypes side (``layers.c``): the ``Proj``/``Layer``/``Shape`` structures and
the checked wrapper of ``dflash_layers``."""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from typing import Any

import torch

from runtime.engine.models.kernels.wrappers import _described, _need


class Proj(ctypes.Structure):
    """One projection of ``layers.c``: weights [n, k] (int8 + per-row scales, bf16, float32 or q4 + its
    scales and minimums), bias or NULL."""

    _fields_ = [
        ("w", ctypes.c_void_p),
        ("scale", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("n", ctypes.c_int64),
        ("k", ctypes.c_int64),
        # weights: 0 = bf16, 1 = int8, 2 = float32, 3 = bf16 on the AVX-512-BF16 path, 4 = q4 (scale: its sm)
        ("kind", ctypes.c_int64),
    ]


class Layer(ctypes.Structure):
    """One decoder layer of ``layers.c`` (pointers into tensors the caller keeps alive)."""

    _fields_ = [
        ("qkv", Proj),
        ("o", Proj),
        ("gate_up", Proj),
        ("down", Proj),
        ("ln1", ctypes.c_void_p),
        ("ln2", ctypes.c_void_p),
        ("q_norm", ctypes.c_void_p),
        ("k_norm", ctypes.c_void_p),
        ("eps1", ctypes.c_float),
        ("eps2", ctypes.c_float),
        ("qk_eps", ctypes.c_float),
        ("scaling", ctypes.c_float),
    ]


class Shape(ctypes.Structure):
    """The model's shape for ``layers.c``."""

    _fields_ = [(name, ctypes.c_int64) for name in ("d", "heads", "kv_heads", "head_dim", "ffn")]


LayersFn = Callable[..., None]


def _wrap_layers(c_fn: ctypes._NamedFuncPointer) -> LayersFn:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    c_fn.restype = ctypes.c_int
    c_fn.argtypes = [p, i64, p, p, p, i64, p, i64, i64, p, p, p, p, i64, p, ctypes.c_int]
    name = "native layers"

    def layers(
        stack: Any,
        shape: Shape,
        ck: Any,
        cv: Any,
        capacity: int,
        h: torch.Tensor,
        start: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        taps: Sequence[int],
        tapbuf: torch.Tensor | None,
    ) -> None:
        """Run the decoder layers ``stack`` (a ctypes ``Layer`` array) over the rows ``h`` [T, D]
        (float32, updated in place) at positions ``start``..``start + T - 1``, reading and writing
        the per-layer K/V buffers ``ck``/``cv`` (ctypes pointer arrays, room for ``capacity``
        entries). ``cos``/``sin`` [T, head_dim] float32; ``mask`` [T, start + T] uint8 or None
        (causal); after layer ``taps[j]`` the rows are copied into ``tapbuf[:, j * D:(j + 1) * D]``.

        Raises:
            ValueError: a tensor of the wrong dtype, shape or layout, or positions beyond the cache.
            MemoryError: no scratch memory for the step.
        """
        n_layers = len(stack)
        if len(ck) != n_layers or len(cv) != n_layers:
            raise ValueError(f"{name}: {n_layers} layers but {len(ck)} K and {len(cv)} V buffers")
        d, hd = int(shape.d), int(shape.head_dim)
        if not isinstance(h, torch.Tensor) or h.dim() != 2 or h.shape[0] < 1:
            raise ValueError(f"{name}: h must be a 2-D tensor [T, {d}] with T >= 1, {_described(h)}")
        t = int(h.shape[0])
        _need(name, "h", h, torch.float32, (t, d))
        _need(name, "cos", cos, torch.float32, (t, hd))
        _need(name, "sin", sin, torch.float32, (t, hd))
        if not 0 <= start <= capacity - t:
            raise ValueError(f"{name}: rows {start}..{start + t - 1} do not fit a cache of {capacity} entries")
        if mask is not None:
            _need(name, "mask", mask, torch.uint8, (t, start + t))
        if any(not 0 <= j < n_layers for j in taps):
            raise ValueError(f"{name}: taps {list(taps)} outside layers 0..{n_layers - 1}")
        if taps:
            _need(name, "tapbuf", tapbuf, torch.float32, (t, len(taps) * d))
        elif tapbuf is not None:
            raise ValueError(f"{name}: a tap buffer without taps")
        tap_ids = (ctypes.c_int64 * max(len(taps), 1))(*taps)
        rc = c_fn(
            stack,
            n_layers,
            ctypes.byref(shape),
            ck,
            cv,
            capacity,
            h.data_ptr(),
            t,
            start,
            cos.data_ptr(),
            sin.data_ptr(),
            mask.data_ptr() if mask is not None else None,
            tap_ids,
            len(taps),
            tapbuf.data_ptr() if tapbuf is not None else None,
            torch.get_num_threads(),
        )
        if rc == -2:
            raise ValueError(f"{name}: head dimension {hd} over 512")
        if rc != 0:
            raise MemoryError(f"{name}: no memory for a step of {t} rows (code {rc})")

    return layers
