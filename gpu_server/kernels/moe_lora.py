"""Fused MoE with multi-adapter LoRA: shrink/expand grouped by expert slot and adapter.

    gate_up = W13[s] x + B13[a, s] (A13[a, s] x)        a = token_adapter[t], -1 = base
    act     = silu(gate_up[:I]) * gate_up[I:]            the delta goes in BEFORE the activation
    y       = weights[t, k] * (W2[s] act + B2[a, s] (A2[a, s] act))
    out[t]  = sum_k y

The (token, k) pairs are aligned by slot exactly as in the plain fused MoE (align.py), so each
expert's base weights are streamed once however many adapters its tokens use; inside a block,
each adapter present multiplies its own rows by its (A, B) of that slot. Two strategies:

- ``inloop`` (moe_lora_inloop.py): the shrink rides along the base K loop: no extra launch, best
  when blocks hold one adapter (decode: about one row per slot);
- ``split`` (moe_lora_split.py): separate shrink kernels, then the base GEMMs with the expands:
  two more launches, but no per-block serial pass for blocks mixing adapters (prefill).

``auto`` takes ``inloop`` when at most ``INLOOP_ROWS_PER_SLOT`` rows per slot are expected
(uniform routing), else ``split`` (measured on H100, benchmarks/RESULTS.md). The
shrink outputs are rounded to the activation dtype before the expand, as PEFT's lora_A outputs
are. No host synchronisation: the whole thing can be captured in a CUDA graph.

Beside (not inside) kernels/grouped_gemm.py so the base kernels stay as tuned; the alignment,
tile order, reduction over k and launch configs are shared.

Shapes: T tokens, K top-k, H hidden, I intermediate, S slots, L adapter slots, R13/R2 ranks
(BLOCK_R: padded to a power of two >= 16), P = T*K pairs, Rw aligned rows.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import triton

from expertmesh.lora import MoELoRAWeights
from gpu_server.kernels import moe_lora_inloop as inloop
from gpu_server.kernels import moe_lora_split as split
from gpu_server.kernels.align import Alignment, align_pairs
from gpu_server.kernels.config import GemmConfig, MoeConfig, default_config, fit_shared_memory
from gpu_server.kernels.fused_moe import check_inputs
from gpu_server.kernels.grouped_gemm import _flags
from gpu_server.kernels.reduce import sum_k

STRATEGIES = ("auto", "inloop", "split")
INLOOP_ROWS_PER_SLOT = 2


def _block_r(rank: int) -> int:
    return max(16, triton.next_power_of_2(rank))  # tl.dot needs >= 16


def check_lora(x: torch.Tensor, w13: torch.Tensor, lora: MoELoRAWeights, token_adapter: torch.Tensor) -> None:
    s, i2, h = w13.shape
    assert lora.a13.shape[1] == s and lora.a13.shape[3] == h, f"{lora.a13.shape=} {w13.shape=}"
    assert lora.b13.shape[2] == i2 and lora.a2.shape[3] == i2 // 2, f"{lora.b13.shape=} {lora.a2.shape=}"
    for t in (lora.a13, lora.b13, lora.a2, lora.b2):
        assert t.dtype == x.dtype and t.device == x.device and t.stride(-1) == 1, f"{t.dtype=} {t.device=}"
    assert token_adapter.shape == (x.shape[0],) and not token_adapter.is_floating_point(), (
        f"{token_adapter.shape=}"
    )


def _fit(cfg: GemmConfig, block_m: int, b_tiles: int, block_r: int, itemsize: int) -> GemmConfig:
    """The in-loop kernels pipeline one more [BK, BR] tile per stage: count it like BR more rows."""
    fitted = fit_shared_memory(cfg, block_m + block_r, b_tiles, itemsize)
    return replace(fitted, num_stages=max(2, fitted.num_stages))


def fused_moe_lora(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [S, 2I, H]
    w2: torch.Tensor,  # [S, H, I]
    slot_ids: torch.Tensor,  # [T, K] int, -1 = not here
    weights: torch.Tensor,  # [T, K] float32
    lora: MoELoRAWeights,  # [L, S, ...] in x's dtype
    token_adapter: torch.Tensor,  # [T] int, -1 = base; must be < L (checked by the caller)
    config: MoeConfig | None = None,
    out: torch.Tensor | None = None,
    strategy: str = "auto",
) -> torch.Tensor:  # [T, H]
    check_inputs(x, w13, w2, slot_ids, weights)
    check_lora(x, w13, lora, token_adapter)
    assert strategy in STRATEGIES, f"{strategy=}"
    t, h = x.shape
    num_slots = w13.shape[0]
    top_k = slot_ids.shape[1]
    if out is None:
        out = torch.empty_like(x)
    if t == 0 or top_k == 0:
        return out.zero_()
    cfg = (config or default_config(t, top_k, num_slots)).fitted(x.element_size())
    if strategy == "auto":
        strategy = "inloop" if t * top_k <= INLOOP_ROWS_PER_SLOT * num_slots else "split"
    x = x.contiguous()
    slot_ids = slot_ids.to(torch.int32).contiguous()
    adapters = token_adapter.to(torch.int32).contiguous()
    topw = weights.to(torch.float32).contiguous()
    al = align_pairs(slot_ids, num_slots, cfg.block_m)
    run = _inloop if strategy == "inloop" else _split
    y = run(x, w13, w2, topw, lora, adapters, al, cfg, top_k)  # [P, H]
    sum_k(y, slot_ids, out)
    return out


def _inloop(x, w13, w2, topw, lora: MoELoRAWeights, adapters, al: Alignment, cfg: MoeConfig, top_k: int):
    t, h = x.shape
    inter = w2.shape[2]
    num_adapters = lora.num_adapters
    r13, r2 = lora.a13.shape[2], lora.a2.shape[2]
    gu = _fit(cfg.gate_up, al.block_m, 2, _block_r(r13), x.element_size())
    dn = _fit(cfg.down, al.block_m, 1, _block_r(r2), x.element_size())
    act = torch.empty(al.sorted_pairs.shape[0], inter, dtype=x.dtype, device=x.device)  # [Rw, I]
    a13, b13 = lora.a13, lora.b13
    inloop._gate_up_lora_kernel[(al.max_blocks * triton.cdiv(inter, gu.block_n),)](
        x, w13, a13, b13, act, al.sorted_pairs, al.block_slot, al.slot_start, al.slot_count, adapters,
        al.max_blocks, num_adapters, h, inter, r13, top_k,
        x.stride(0), w13.stride(0), w13.stride(1), w13.stride(2),
        a13.stride(0), a13.stride(1), a13.stride(2), b13.stride(0), b13.stride(1), b13.stride(2), act.stride(0),
        BLOCK_M=al.block_m, BLOCK_N=gu.block_n, BLOCK_K=gu.block_k, BLOCK_R=_block_r(r13), GROUP_M=gu.group_m,
        EVEN_K=h % gu.block_k == 0, num_warps=gu.num_warps, num_stages=gu.num_stages, **_flags(x),
    )  # fmt: skip
    y = torch.empty(t * top_k, h, dtype=x.dtype, device=x.device)  # [P, H]
    a2, b2 = lora.a2, lora.b2
    inloop._down_lora_kernel[(al.max_blocks * triton.cdiv(h, dn.block_n),)](
        act, w2, a2, b2, y, topw, al.sorted_pairs, al.block_slot, al.slot_start, al.slot_count, adapters,
        al.max_blocks, num_adapters, h, inter, r2, top_k,
        act.stride(0), w2.stride(0), w2.stride(1), w2.stride(2),
        a2.stride(0), a2.stride(1), a2.stride(2), b2.stride(0), b2.stride(1), b2.stride(2), y.stride(0),
        BLOCK_M=al.block_m, BLOCK_N=dn.block_n, BLOCK_K=dn.block_k, BLOCK_R=_block_r(r2), GROUP_M=dn.group_m,
        EVEN_K=inter % dn.block_k == 0, num_warps=dn.num_warps, num_stages=dn.num_stages, **_flags(act),
    )  # fmt: skip
    return y


def _shrink(src, la, al: Alignment, adapters, top_k, gather: bool, block_k: int) -> torch.Tensor:
    """v [Rw, BLOCK_R] <- A[a_r, s] src_r for rows with an adapter, 0 elsewhere."""
    rank, fan_in = la.shape[2], la.shape[3]
    block_r = _block_r(rank)
    v = torch.empty(al.sorted_pairs.shape[0], block_r, dtype=src.dtype, device=src.device)
    split._shrink_kernel[(al.max_blocks,)](
        src, la, v, al.sorted_pairs, al.block_slot, al.slot_start, al.slot_count, adapters,
        la.shape[0], fan_in, rank, top_k,
        src.stride(0), la.stride(0), la.stride(1), la.stride(2), v.stride(0),
        GATHER=gather, BLOCK_M=al.block_m, BLOCK_K=min(block_k, 64), BLOCK_R=block_r, **_flags(src),
    )  # fmt: skip
    return v


def _split(x, w13, w2, topw, lora: MoELoRAWeights, adapters, al: Alignment, cfg: MoeConfig, top_k: int):
    t, h = x.shape
    inter = w2.shape[2]
    num_adapters = lora.num_adapters
    gu, dn = cfg.gate_up, cfg.down
    v13 = _shrink(x, lora.a13, al, adapters, top_k, True, gu.block_k)
    act = torch.empty(al.sorted_pairs.shape[0], inter, dtype=x.dtype, device=x.device)  # [Rw, I]
    r13 = lora.a13.shape[2]
    split._gate_up_expand_kernel[(al.max_blocks * triton.cdiv(inter, gu.block_n),)](
        x, w13, v13, lora.b13, act, al.sorted_pairs, al.block_slot, al.slot_start, al.slot_count, adapters,
        al.max_blocks, num_adapters, h, inter, r13, top_k,
        x.stride(0), w13.stride(0), w13.stride(1), w13.stride(2), v13.stride(0),
        lora.b13.stride(0), lora.b13.stride(1), lora.b13.stride(2), act.stride(0),
        BLOCK_M=al.block_m, BLOCK_N=gu.block_n, BLOCK_K=gu.block_k, BLOCK_R=_block_r(r13), GROUP_M=gu.group_m,
        EVEN_K=h % gu.block_k == 0, num_warps=gu.num_warps, num_stages=gu.num_stages, **_flags(x),
    )  # fmt: skip
    v2 = _shrink(act, lora.a2, al, adapters, top_k, False, dn.block_k)
    y = torch.empty(t * top_k, h, dtype=x.dtype, device=x.device)  # [P, H]
    r2 = lora.a2.shape[2]
    split._down_expand_kernel[(al.max_blocks * triton.cdiv(h, dn.block_n),)](
        act, w2, v2, lora.b2, y, topw, al.sorted_pairs, al.block_slot, al.slot_start, al.slot_count, adapters,
        al.max_blocks, num_adapters, h, inter, r2, top_k,
        act.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), v2.stride(0),
        lora.b2.stride(0), lora.b2.stride(1), lora.b2.stride(2), y.stride(0),
        BLOCK_M=al.block_m, BLOCK_N=dn.block_n, BLOCK_K=dn.block_k, BLOCK_R=_block_r(r2), GROUP_M=dn.group_m,
        EVEN_K=inter % dn.block_k == 0, num_warps=dn.num_warps, num_stages=dn.num_stages, **_flags(act),
    )  # fmt: skip
    return y
