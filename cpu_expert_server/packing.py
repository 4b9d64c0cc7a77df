"""Weight layouts of the CPU expert backend: gate/up interleaving and group-wise quantisation.

Shapes: S slots, I intermediate, H hidden, C a row's input features, G quantisation group,
RB interleave block. The functions are torch, except that :func:`quantize_rows` hands its work to
the C quantiser (kernels/quantise.c) where that builds; the C kernel (kernels/moe_gemv.c) reads
the same layouts.

Row formats (one row = one output feature):
  unquantised  C values in the server's dtype
  int8         C int8, then C/G float32 scales                              w = q * s
  int4         C/2 bytes, then C/G float32 scales; in each group the low nibble of byte j holds
               element j and the high nibble element j + G/2                 w = (nibble - 8) * s
Scales follow their row so one row is one contiguous read.

Tiled format (int8/int4 matrices whose group G % 64 == 0 and whose row count R % 16 == 0, see
:func:`tiled`; every Qwen3/DeepSeek/Mixtral width): rows go in blocks of 16, and a block's
16 * (row bytes) are, instead of 16 rows one after the other,
  for each step of 64 input features: 16 rows x 64 int8 (int4: 16 rows x 32 bytes, the low
    nibble of byte j is feature j of the step, the high nibble feature j + 32)
  then for each group: the 16 rows' float32 scales.
A step is an AMX A tile (16 rows x 64 bytes, read in place), and the VNNI/AVX2 decode kernels
stream a block as one contiguous read, reducing 16 rows' integer sums into one vector per group
so a group's 16 scales apply as one vector multiply. The tensor keeps its [..., R, row bytes]
shape (same bytes per row); only whole blocks are meaningful.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from cpu_expert_server.kernels import quantise as quantise_c

# (name, shape, dtype) -> a buffer the caller may reuse on the next call of the same name (a
# reader thread's own, so a load's expert after expert touch the same pages)
Scratch = Callable[[str, tuple[int, ...], torch.dtype], torch.Tensor]

QUANT_DTYPES = ("int8", "int4")
WEIGHT_DTYPES = ("bfloat16", *QUANT_DTYPES)
# int8 needs fewer scales for the same error; int4 needs small groups (llama.cpp's Q4_0 uses 32)
DEFAULT_GROUP = {"int8": 128, "int4": 64}
# a group of 0: one scale per row (the whole input width; KTransformers' AMXINT4 and AMXINT8 are
# per row). Fewer scale bytes and the prefill kernel folds its integer sums once per row instead
# of once per group, at the cost of accuracy where a row holds outliers.
PER_ROW = 0
QMAX = {"int8": 127, "int4": 7}


def pick_group(c: int, group: int, wdtype: str) -> int:
    """The largest group <= ``group`` that divides ``c`` (even for int4, whose halves pair up)."""
    step = 2 if wdtype == "int4" else 1
    for g in range(min(group, c), 0, -1):
        if c % g == 0 and g % step == 0:
            return g
    raise ValueError(f"no {wdtype} group divides {c=}")


def tiled(wdtype: str, rows: int, g: int) -> bool:
    """Whether a quantised [rows, C] matrix with groups of ``g`` is stored in the tiled format
    (the C kernels apply the same rule, moe_gemv.c q_tiled)."""
    return wdtype in QUANT_DTYPES and g % 64 == 0 and rows % 16 == 0


def pick_block(inter: int) -> int:
    return next(rb for rb in (16, 8, 4, 2, 1) if inter % rb == 0)


@dataclass(frozen=True)
class PackedFormat:
    wdtype: str  # "bfloat16" (kept at the server's dtype) | "int8" | "int4"
    hidden: int  # H
    inter: int  # I
    rb: int  # gate/up interleave block
    g13: int  # group along H (w13 rows)
    g2: int  # group along I (w2 rows)

    def __post_init__(self) -> None:
        assert self.wdtype in WEIGHT_DTYPES, f"{self.wdtype=}"
        assert self.inter % self.rb == 0, f"{self.inter=} {self.rb=}"
        assert self.hidden % self.g13 == 0 and self.inter % self.g2 == 0, f"{self}"

    @classmethod
    def for_shape(cls, wdtype: str, hidden: int, inter: int, group: int | None = None) -> PackedFormat:
        """``group``: None = the dtype's default, :data:`PER_ROW` = one scale per row, else the
        largest group <= it that divides each width."""
        if wdtype not in QUANT_DTYPES:
            return cls(wdtype, hidden, inter, pick_block(inter), 1, 1)
        g = DEFAULT_GROUP[wdtype] if group is None else group
        return cls(
            wdtype,
            hidden,
            inter,
            pick_block(inter),
            pick_group(hidden, g or hidden, wdtype),
            pick_group(inter, g or inter, wdtype),
        )

    @property
    def quantised(self) -> bool:
        return self.wdtype in QUANT_DTYPES


def interleave(w13: torch.Tensor, rb: int) -> torch.Tensor:
    """[S, 2I, H] gate rows then up rows -> [S, 2I, H] in blocks of RB gate rows + RB up rows."""
    s, two_i, h = w13.shape
    return w13.view(s, 2, two_i // 2 // rb, rb, h).transpose(1, 2).reshape(s, two_i, h)


def split_gate_up(gu: torch.Tensor, rb: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, 2I] computed with interleaved rows -> gate [n, I], up [n, I]."""
    n, two_i = gu.shape
    v = gu.view(n, two_i // 2 // rb, 2, rb)
    return v[:, :, 0].reshape(n, -1), v[:, :, 1].reshape(n, -1)


def row_bytes(wdtype: str, c: int, g: int) -> int:
    """Bytes of one quantised row of ``c`` features: the body, then C/G float32 scales."""
    return (c if wdtype == "int8" else c // 2) + 4 * (c // g)


def quantize_rows(
    w: torch.Tensor, wdtype: str, g: int, out: torch.Tensor | None = None, scratch: Scratch | None = None
) -> torch.Tensor:
    """[..., R, C] float -> [..., R, row bytes] uint8, tiled when :func:`tiled` says so, else in
    the row format above; written into ``out`` when given (a contiguous slot: a load then
    allocates no packed copy per expert).

    The C quantiser (kernels/quantise.py) writes the bytes where it builds and takes the
    tensors, without the GIL, so a load's reader threads quantise side by side; else
    :func:`quantize_rows_torch`, the same bytes (its temporaries from ``scratch``)."""
    *lead, c = w.shape
    if out is None:
        out = torch.empty(*lead, row_bytes(wdtype, c, g), dtype=torch.uint8, device=w.device)
    is_tiled = len(lead) >= 1 and tiled(wdtype, lead[-1], g)
    if quantise_c.quantise(w, wdtype, g, is_tiled, out):
        return out
    return quantize_rows_torch(w, wdtype, g, out, scratch)


def quantize_rows_torch(
    w: torch.Tensor, wdtype: str, g: int, out: torch.Tensor | None = None, scratch: Scratch | None = None
) -> torch.Tensor:
    """:func:`quantize_rows` in torch: the definition of the bytes, and the fallback."""
    *lead, c = w.shape
    if len(lead) >= 1 and tiled(wdtype, lead[-1], g):
        return _quantize_tiled(w, wdtype, g, out, scratch)
    if out is None:
        return _quantize(w, wdtype, g)
    return out.copy_(_quantize(w, wdtype, g))


_BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def _fresh(like: torch.Tensor) -> Scratch:
    """A :data:`Scratch` that allocates every buffer, on ``like``'s device."""
    return lambda name, shape, dtype: torch.empty(shape, dtype=dtype, device=like.device)


def _absmax(wg: torch.Tensor, buf: Scratch | None = None) -> torch.Tensor:
    """[..., G] -> max |w| over the last dim, in float32. On the bits: clearing the sign bit
    of an IEEE float is |w|, and non-negative floats order as their bits do (a NaN stays the
    largest, as amax propagates it); torch reduces integers several times faster than bf16.
    The bits, maxima and result are written into ``buf``'s buffers."""
    ity = _BITS.get(wg.dtype)
    if ity is None:
        return wg.abs().amax(-1).float()
    mask = 0x7FFF if ity == torch.int16 else 0x7FFFFFFF
    buf = buf or _fresh(wg)
    shape = tuple(wg.shape)
    bits = torch.bitwise_and(wg.view(ity), mask, out=buf("quant.bits", shape, ity))
    top = torch.amax(bits, -1, out=buf("quant.max", shape[:-1], ity))
    # NOTE: bf16 -> float32 is exact, so this copy is the .float() it replaces
    return buf("quant.scale", shape[:-1], torch.float32).copy_(top.view(wg.dtype))


def _levels(
    w: torch.Tensor, wdtype: str, g: int, buf: Scratch | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., R, C] -> the codes stored [..., R, C/G, G] (float32: int8 levels in [-127, 127],
    int4 levels + 8 in [0, 15]) and the scales [..., R, C/G], in ``buf``'s buffers.

    NOTE: ``w / scale`` promotes to float32 exactly as ``w.float() / scale`` does, so no float32
    copy of w is made; the rest runs in place (a load quantises tens of GB here)."""
    *lead, c = w.shape
    buf = buf or _fresh(w)
    wg = w.reshape(*lead, c // g, g)  # [..., C/G, G]
    scale = _absmax(wg, buf).div_(QMAX[wdtype]).clamp_min_(1e-12)  # [..., C/G]
    q = torch.div(wg, scale[..., None], out=buf("quant.codes", tuple(wg.shape), torch.float32)).round_()
    if wdtype == "int8":
        return q.clamp_(-QMAX["int8"], QMAX["int8"]), scale
    return q.add_(8).clamp_(0, 15), scale  # clamp(q, -8, 7) + 8, exactly


def _quantize(w: torch.Tensor, wdtype: str, g: int) -> torch.Tensor:
    *lead, c = w.shape
    q, scale = _levels(w, wdtype, g)
    if wdtype == "int8":
        body = q.to(torch.int8).reshape(*lead, c).view(torch.uint8)
    else:
        nib = q.to(torch.uint8)  # [..., C/G, G] in [0, 15]
        body = (nib[..., : g // 2] | (nib[..., g // 2 :] << 4)).reshape(*lead, c // 2)
    return torch.cat([body, scale.contiguous().view(torch.uint8)], dim=-1)


# rows quantised at a time: a block's float32 codes stay in a core's L2 cache across the passes
_BLOCK_BYTES = 1 << 20


def _quantize_tiled(
    w: torch.Tensor, wdtype: str, g: int, out: torch.Tensor | None = None, scratch: Scratch | None = None
) -> torch.Tensor:
    """:func:`_quantize` then :func:`_to_tiles`, with the codes written straight into their
    tile positions, a few blocks of 16 rows at a time (the same bytes, several times faster;
    few torch calls per block, as several reader threads run this at once)."""
    *lead, r, c = w.shape
    body = c if wdtype == "int8" else c // 2
    nbytes = body + 4 * (c // g)
    if out is None:
        out = torch.empty(*lead, r, nbytes, dtype=torch.uint8, device=w.device)
    assert out.shape == (*lead, r, nbytes) and out.dtype == torch.uint8, f"{out.shape=} {w.shape=}"
    assert out.is_contiguous(), "tiles are written through a view of out's blocks"
    n = out.numel() // nbytes  # rows of every matrix: each block of 16 lies in one (R % 16 == 0)
    blocks = out.view(n // 16, 16 * nbytes)
    step = 64 if wdtype == "int8" else 32  # bytes of one row per 64 input features
    # a block's bodies [C/64, 16, step] seen as [16, C/64, step] (a row's steps), then its
    # scales [C/G, 16] float32 seen as [16, C/G]
    tiles = blocks[:, : 16 * body].unflatten(-1, (c // 64, 16, step)).transpose(-3, -2)
    tiles = tiles.view(torch.int8) if wdtype == "int8" else tiles
    scales = blocks[:, 16 * body :].view(torch.float32).unflatten(-1, (c // g, 16)).transpose(-2, -1)
    flat = w.reshape(n, c)
    rows = _block_rows(c)
    # NOTE: the blocks' temporaries (the absmax's bits, the float32 codes, int4's paired
    # nibbles; ~2.5 MB) come from ``scratch`` (else from one allocation per matrix), never
    # one per block: glibc hands freed memory at the top of a thread's arena back to the
    # kernel, and the next block faulted those pages in again (as many faults as the slots')
    kept: dict[str, torch.Tensor] = {}

    def buf(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The first ``shape[0]`` rows' worth of a buffer sized for a whole block."""
        full = (rows if name != "quant.pairs" else shape[0], *shape[1:])
        t = kept.get(name)
        if t is None:
            t = (scratch or _fresh(w))(name, full, dtype)
            kept[name] = t
        return t[: shape[0]]

    for a in range(0, n, rows):
        b = min(rows, n - a)
        q, scale = _levels(flat[a : a + b], wdtype, g, buf)  # [B, C/G, G], [B, C/G]
        k, at = b // 16, a // 16
        if wdtype == "int8":
            tiles[at : at + k].copy_(q.view(k, 16, c // 64, 64))
        else:
            # a step's byte j: feature j in the low nibble, j + 32 in the high one
            lo, hi = q.view(k, 16, c // 64, 2, 32).unbind(-2)
            pairs = buf("quant.pairs", (rows // 16, 16, c // 64, 32), torch.float32)[:k]
            tiles[at : at + k].copy_(torch.add(lo, hi, alpha=16, out=pairs))
        scales[at : at + k].copy_(scale.view(k, 16, c // g))
    return out


def _block_rows(c: int) -> int:
    """Rows of C features quantised at a time (a multiple of 16): about _BLOCK_BYTES of codes."""
    return max(16, _BLOCK_BYTES // (4 * c) // 16 * 16)


def _to_tiles(rows: torch.Tensor, wdtype: str, c: int, g: int) -> torch.Tensor:
    """[..., R, row bytes] in the row format (G % 64 == 0) -> the same bytes tiled."""
    *lead, r, nbytes = rows.shape
    step = 64 if wdtype == "int8" else 32  # bytes of one row per 64 input features
    body = c if wdtype == "int8" else c // 2
    # [..., R/16, C/64, 16, step]
    w = rows[..., :body].reshape(*lead, r // 16, 16, c // 64, step).transpose(-3, -2)
    if wdtype == "int4" and g != 64:
        # the row format pairs j with j + G/2 inside a group; tiles pair j with j + 32 per step
        q = _nibbles(rows[..., :body], c, g)  # [..., R, C] 0..15
        q = q.reshape(*lead, r // 16, 16, c // 64, 2, 32)
        w = (q[..., 0, :] | (q[..., 1, :] << 4)).transpose(-3, -2)
    sc = rows[..., body:].reshape(*lead, r // 16, 16, c // g, 4).transpose(-3, -2)  # [.., R/16, C/G, 16, 4]
    blocks = torch.cat(
        [w.reshape(*lead, r // 16, 16 * body), sc.reshape(*lead, r // 16, 64 * (c // g))], dim=-1
    )
    return blocks.reshape(*lead, r, nbytes)


def _from_tiles(tiles: torch.Tensor, wdtype: str, c: int, g: int) -> torch.Tensor:
    """Inverse of :func:`_to_tiles`: [..., R, row bytes] tiled -> the row format."""
    *lead, r, nbytes = tiles.shape
    step = 64 if wdtype == "int8" else 32
    body = c if wdtype == "int8" else c // 2
    b = tiles.reshape(*lead, r // 16, 16 * nbytes)
    # [..., R/16, 16, C/64, step]
    w = b[..., : 16 * body].reshape(*lead, r // 16, c // 64, 16, step).transpose(-3, -2)
    if wdtype == "int4" and g != 64:
        lo, hi = w & 15, w >> 4  # [.., R/16, 16, C/64, 32] each
        q = torch.stack([lo, hi], dim=-2).reshape(*lead, r, c // g, 2, g // 2)
        w = q[..., 0, :] | (q[..., 1, :] << 4)
    sc = b[..., 16 * body :].reshape(*lead, r // 16, c // g, 16, 4).transpose(-3, -2)
    return torch.cat([w.reshape(*lead, r, body), sc.reshape(*lead, r, 4 * (c // g))], dim=-1)


def _nibbles(body: torch.Tensor, c: int, g: int) -> torch.Tensor:
    """int4 row-format bodies [..., C/2] -> nibbles [..., C] (0..15) in feature order."""
    *lead, _ = body.shape
    b = body.reshape(*lead, c // g, g // 2)
    return torch.cat([(b & 15), (b >> 4)], dim=-1).reshape(*lead, c)


def dequantize_rows(rows: torch.Tensor, wdtype: str, c: int, g: int) -> torch.Tensor:
    """[..., R, row bytes] uint8 -> [..., R, C] float32 (the torch fallback and the tests use
    this); tiled matrices (:func:`tiled`) are recognised by their shape."""
    if rows.dim() >= 2 and tiled(wdtype, rows.shape[-2], g):
        rows = _from_tiles(rows, wdtype, c, g)
    *lead, nbytes = rows.shape
    body_len = c if wdtype == "int8" else c // 2
    scale = rows[..., body_len:].contiguous().view(torch.float32)  # [..., C/G]
    body = rows[..., :body_len]
    if wdtype == "int8":
        q = body.contiguous().view(torch.int8).float().reshape(*lead, c // g, g)
    else:
        b = body.reshape(*lead, c // g, g // 2)
        q = torch.cat([(b & 15), (b >> 4)], dim=-1).float() - 8  # [..., C/G, G]
    return (q * scale[..., None]).reshape(*lead, c)


def pack(w13: torch.Tensor, w2: torch.Tensor, fmt: PackedFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """[S, 2I, H], [S, H, I] -> the backend's layout: interleaved w13, rows quantised if asked."""
    w13 = interleave(w13, fmt.rb)
    if not fmt.quantised:
        return w13.contiguous(), w2.contiguous()
    return quantize_rows(w13, fmt.wdtype, fmt.g13), quantize_rows(w2, fmt.wdtype, fmt.g2)


def unpack(
    w13: torch.Tensor, w2: torch.Tensor, fmt: PackedFormat, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack` (up to quantisation): plain [S, 2I, H], [S, H, I] in ``dtype``."""
    if fmt.quantised:
        w13 = dequantize_rows(w13, fmt.wdtype, fmt.hidden, fmt.g13)
        w2 = dequantize_rows(w2, fmt.wdtype, fmt.inter, fmt.g2)
    s = w13.shape[0]
    w13 = (
        w13.reshape(s, fmt.inter // fmt.rb, 2, fmt.rb, fmt.hidden).transpose(1, 2).reshape(s, -1, fmt.hidden)
    )
    return w13.to(dtype), w2.to(dtype)
