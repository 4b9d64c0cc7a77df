"""The load-time quantiser in C (``quantise.c``): packing.py's int8/int4 row and tiled formats,
byte for byte, one call per matrix.

A load quantises every expert on several reader threads at once. The torch path makes hundreds
of small calls per expert and holds the GIL between them, so those threads mostly wait on each
other; a ctypes call releases the GIL for its whole length, so here they run side by side.

Built as its own library, without the MoE kernels' ``-ffast-math``: that would replace the
division by the scale with a reciprocal multiply and change the bytes.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from expertmesh.cbuild import CachedLibrary

SOURCES = (Path(__file__).with_name("quantise.c"),)
# NOTE: no -ffast-math, and no contraction into fused multiply-adds: IEEE float32 as torch does it
FLAGS = ["-O3", "-fPIC", "-shared", "-ffp-contract=off"]
# quantise.c IN_* and Q_*
_IN = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
_Q = {"int8": 0, "int4": 1}
QUANT_OK = 0
# quantise.c's copies of its loops, by the index quantise_isa() gives the widest of
ISAS = ("baseline", "avx2", "avx512")


def _declare(lib: ctypes.CDLL) -> None:
    p, i, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.quantise_rows.argtypes = [p, i, i64, i64, i, i64, i, p, i]
    lib.quantise_rows.restype = i
    lib.quantise_isa.argtypes = []
    lib.quantise_isa.restype = i


_LIB = CachedLibrary("the C quantiser", "quantise", SOURCES, FLAGS, _declare)
build, load, unavailable = _LIB.build, _LIB.load, _LIB.unavailable


def supported(w: torch.Tensor, wdtype: str, g: int, out: torch.Tensor) -> bool:
    """Whether :func:`quantise` takes these tensors: on the CPU, w in a float dtype it reads,
    ``out`` a contiguous uint8 [..., R, row bytes] (anything else is the torch path's)."""
    if w.device.type != "cpu" or w.dtype not in _IN or wdtype not in _Q or w.dim() == 0:
        return False
    c = w.shape[-1]
    if g <= 0 or c % g or (wdtype == "int4" and g % 2):
        return False
    nbytes = (c if wdtype == "int8" else c // 2) + 4 * (c // g)
    return (
        out.device.type == "cpu"
        and out.dtype == torch.uint8
        and out.is_contiguous()
        and out.shape == (*w.shape[:-1], nbytes)
    )


def isa() -> int:
    """The widest of :data:`ISAS` this CPU runs the C loops in (-1: no library)."""
    lib = load()
    return -1 if lib is None else int(lib.quantise_isa())


def quantise(
    w: torch.Tensor, wdtype: str, g: int, tiled: bool, out: torch.Tensor, isa: int | None = None
) -> bool:
    """w [..., R, C] -> out [..., R, row bytes]: packing.quantize_rows' bytes, tiled when
    ``tiled`` (packing.tiled's rule). False, with ``out`` partly written, where the C path does
    not apply: no library, tensors :func:`supported` refuses, or an inf or NaN in w (the torch
    path's codes for those come from converting NaN to an integer, so they stay torch's).
    ``isa``: the loops of :data:`ISAS` to run (tests: each gives the same bytes), default the
    widest this CPU has."""
    lib = load()
    if lib is None or not supported(w, wdtype, g, out):
        return False
    w = w.contiguous()  # a no-op for a load's scratch and pack's interleaved copy
    rows = out.numel() // out.shape[-1] if out.numel() else 0
    if rows == 0:
        return True
    level = lib.quantise_isa() if isa is None else isa
    rc = lib.quantise_rows(
        w.data_ptr(), _IN[w.dtype], rows, w.shape[-1], _Q[wdtype], g, int(tiled), out.data_ptr(), level
    )
    return rc == QUANT_OK
