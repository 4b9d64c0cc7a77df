"""The fused MoE entry point: alignment, gate_up GEMM, down GEMM, reduction over k.

    out[t] = sum_k weights[t, k] * w2[s] @ (silu(w13[s, :I] x[t]) * (w13[s, I:] x[t])),  s = slot_ids[t, k]

Four stages (six launches), no host synchronisation, so a caller may capture it in a CUDA graph.
Shapes: T tokens, K top-k, H hidden, I intermediate, S local slots.
"""

from __future__ import annotations

import torch

from gpu_server.kernels.align import align_pairs
from gpu_server.kernels.config import MoeConfig, default_config
from gpu_server.kernels.grouped_gemm import down, gate_up
from gpu_server.kernels.reduce import sum_k

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_inputs(x, w13, w2, slot_ids, weights) -> None:
    t, h = x.shape
    s, i2, h13 = w13.shape
    assert x.dtype in DTYPES and w13.dtype == x.dtype and w2.dtype == x.dtype, (
        f"{x.dtype=} {w13.dtype=} {w2.dtype=}"
    )
    assert h13 == h and i2 % 2 == 0 and tuple(w2.shape) == (s, h, i2 // 2), (
        f"{x.shape=} {w13.shape=} {w2.shape=}"
    )
    assert slot_ids.dim() == 2 and slot_ids.shape[0] == t, f"{slot_ids.shape=} {x.shape=}"
    assert not slot_ids.is_floating_point(), f"{slot_ids.dtype=}"
    assert weights.shape == slot_ids.shape, f"{weights.shape=} {slot_ids.shape=}"
    assert x.device == w13.device == w2.device == slot_ids.device == weights.device


def fused_moe(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [S, 2I, H] rows 0..I-1 gate, I..2I-1 up
    w2: torch.Tensor,  # [S, H, I]
    slot_ids: torch.Tensor,  # [T, K] int, -1 = not here; ids must be < S (checked by the caller)
    weights: torch.Tensor,  # [T, K] routing weights (float32)
    config: MoeConfig | None = None,
    out: torch.Tensor | None = None,  # [T, H] written in full when given
) -> torch.Tensor:  # [T, H], dtype of x
    check_inputs(x, w13, w2, slot_ids, weights)
    t, h = x.shape
    num_slots, inter = w13.shape[0], w2.shape[2]
    top_k = slot_ids.shape[1]
    if out is None:
        out = torch.empty_like(x)
    assert out.shape == x.shape and out.dtype == x.dtype, f"{out.shape=} {out.dtype=}"
    if t == 0 or top_k == 0:
        return out.zero_()
    cfg = (config or default_config(t, top_k, num_slots)).fitted(x.element_size())
    x = x.contiguous()
    slot_ids = slot_ids.to(torch.int32).contiguous()  # [T, K]
    topw = weights.to(torch.float32).contiguous()  # [T, K]

    al = align_pairs(slot_ids, num_slots, cfg.block_m)
    act = torch.empty(al.sorted_pairs.shape[0], inter, dtype=x.dtype, device=x.device)  # [R, I]
    gate_up(x, w13, al, top_k, cfg.gate_up, act)
    y = torch.empty(t * top_k, h, dtype=x.dtype, device=x.device)  # [T*K, H]
    down(act, w2, topw, al, cfg.down, y)
    sum_k(y, slot_ids, out)
    return out
