"""Quantised checkpoints: which ``quantization_config`` this code implements, and FP8 block maths.

Implemented: FP8 block quantisation as DeepSeek-V3/R1, Kimi-K2 and Qwen3-*-FP8 publish it
(``quant_method: fp8``, ``fmt: e4m3``, ``activation_scheme: dynamic``, ``weight_block_size:
[bn, bk]``): each quantised linear ``W [N, K]`` is stored as ``weight`` (float8_e4m3fn) plus
``weight_scale_inv [ceil(N/bn), ceil(K/bk)]`` (float32, or UE8M0), and ``W = weight * scale`` of
its block (the name says "inv" because it is the inverse of the quantiser's scale). Edge blocks
may be partial when N or K is not a multiple of the block.

Everything else (GPTQ, AWQ, bitsandbytes, compressed-tensors, MXFP4, static activation scales,
per-tensor FP8 ...) is refused with a :class:`QuantizationError` naming ``quant_method``: those
weights would otherwise be read as if they were plain floats.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

SCALE_SUFFIX = "_scale_inv"  # "...proj.weight" -> "...proj.weight_scale_inv"
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
# the scale dtypes published: float32 (DeepSeek-V3, Qwen3-FP8), UE8M0 powers of two (V3.1+)
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float8_e8m0fnu)


class QuantizationError(ValueError):
    """The checkpoint is quantised in a way this code does not implement."""


@dataclass(frozen=True)
class FP8BlockQuant:
    """FP8 (e4m3) weights with one scale per ``block = (rows, cols)`` tile."""

    block: tuple[int, int]

    def __post_init__(self) -> None:
        assert len(self.block) == 2 and min(self.block) > 0, self.block

    def scale_shape(self, rows: int, cols: int) -> tuple[int, int]:
        return -(-rows // self.block[0]), -(-cols // self.block[1])


def parse_quantization(raw: dict[str, Any]) -> FP8BlockQuant | None:
    """``config.json``'s ``quantization_config`` -> what to do, or QuantizationError."""
    qc = raw.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise QuantizationError(f"quantization_config must be an object, got {qc!r}")
    method = qc.get("quant_method")
    if method != "fp8":
        raise QuantizationError(
            f"unsupported quantization_config quant_method={method!r}: only FP8 block quantisation "
            "(quant_method 'fp8' with weight_block_size, as DeepSeek-V3 and Qwen3-FP8 publish) is "
            "implemented; use an unquantised (bf16) checkpoint"
        )
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise QuantizationError(f"unsupported quantization_config quant_method='fp8' fmt={fmt!r} (only e4m3)")
    act = qc.get("activation_scheme", "dynamic")
    if act != "dynamic":
        raise QuantizationError(
            f"unsupported quantization_config quant_method='fp8' activation_scheme={act!r} "
            "(static activation scales are not implemented)"
        )
    block = qc.get("weight_block_size")
    if not (
        isinstance(block, (list, tuple))
        and len(block) == 2
        and all(isinstance(b, int) and b > 0 for b in block)
    ):
        raise QuantizationError(
            f"unsupported quantization_config quant_method='fp8' weight_block_size={block!r} "
            "(per-tensor FP8 is not implemented; expected [rows, cols])"
        )
    return FP8BlockQuant((int(block[0]), int(block[1])))


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """weight [..., N, K] float8 * its block's scale [..., ceil(N/bn), ceil(K/bk)] -> float32.

    float32 holds the product of a 4-bit-mantissa e4m3 value and a float32 scale with at most one
    rounding, so casting the result to bf16 afterwards rounds exactly once."""
    *lead, n, k = weight.shape
    bn, bk = block
    want = (*lead, -(-n // bn), -(-k // bk))
    if tuple(scale_inv.shape) != want:
        raise QuantizationError(
            f"scale shape {list(scale_inv.shape)} does not tile weight {list(weight.shape)} in "
            f"{bn}x{bk} blocks (expected {list(want)})"
        )
    scale = scale_inv.float().repeat_interleave(bn, dim=-2).repeat_interleave(bk, dim=-1)
    return weight.float() * scale[..., :n, :k]


def quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] -> (float8_e4m3fn [..., N, K], scale_inv float32 [..., ceil(N/bn), ceil(K/bk)]):
    each block scaled so its largest magnitude maps to 448 (how FP8 checkpoints are made; used
    by tests and benchmarks to make them)."""
    *lead, n, k = w.shape
    bn, bk = block
    nb, kb = -(-n // bn), -(-k // bk)
    padded = w.new_zeros(*lead, nb * bn, kb * bk, dtype=torch.float32)
    padded[..., :n, :k] = w.float()
    tiles = padded.unflatten(-1, (kb, bk)).unflatten(-3, (nb, bn))  # [..., nb, bn, kb, bk]
    amax = tiles.abs().amax(dim=(-3, -1))  # [..., nb, kb]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (tiles / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    q = q.flatten(-2).flatten(-3, -2)[..., :n, :k].to(FP8_DTYPE)
    return q.contiguous(), scale
