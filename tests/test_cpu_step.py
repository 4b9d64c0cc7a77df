"""The CPU step's few-op paths against references written elsewhere: the paged attention (decode
rows batched over pages, chunks with per-step masks) against torch's scaled_dot_product_attention
per sequence, the in-process experts against a per-token float64 computation, and the norm and
rotary against HF transformers' own Qwen3-MoE functions.

Shapes: T tokens, Hq/Hk query/KV heads, D head dim, K top-k, H hidden, I expert intermediate.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from coordinator.model.batch import ForwardBatch
from coordinator.model.cpu_moe import GATHER_BUDGET, CPUExpertBackend, gathered_moe, sorted_moe
from coordinator.model.kv_cache import KVCache, KVCacheSpec
from coordinator.model.models.attention import paged_attention_torch
from coordinator.model.models.layers import RMSNorm, Rotary
from expertmesh.config import ModelConfig
from expertmesh.experts import torch_moe
from tests.test_attention_kernels import make_step

# (cached, new) per sequence: decodes of different lengths, a fresh prefill, an extend over a
# cached prefix, a decode at position 0
CPU = torch.device("cpu")
MIXED = [(0, 5), (7, 1), (3, 6), (20, 1), (0, 1), (33, 1)]


def sdpa_reference(q, k_cache, v_cache, batch: ForwardBatch, scale: float) -> torch.Tensor:  # [T, Hq, Dv]
    """Each sequence's rows gathered through its page table, then torch's SDPA (float64)."""
    hq, hk = q.shape[1], k_cache.shape[1]
    out = torch.zeros(q.shape[0], hq, v_cache.shape[-1], dtype=torch.float64)
    p = batch.page_size
    for b, c in enumerate(batch.chunks):
        pos = torch.arange(c.past + c.length)
        rows = batch.page_table[b].long()[pos // p] * p + pos % p
        k = k_cache[rows].double().transpose(0, 1).repeat_interleave(hq // hk, 0)  # [Hq, S, D]
        v = v_cache[rows].double().transpose(0, 1).repeat_interleave(hq // hk, 0)
        qs = q[c.start : c.start + c.length].double().transpose(0, 1)  # [Hq, n, D]
        seen = pos[None, :] <= (c.past + torch.arange(c.length))[:, None]  # [n, S]
        o = F.scaled_dot_product_attention(qs, k, v, attn_mask=seen, scale=scale)
        out[c.start : c.start + c.length] = o.transpose(0, 1)
    return out


@pytest.mark.parametrize("hq,hk,dk,dv", [(4, 2, 16, 16), (6, 1, 8, 8), (4, 4, 24, 12)])
@pytest.mark.parametrize("head_major", [True, False])
def test_paged_attention_matches_sdpa(hq, hk, dk, dv, head_major):
    """Both cache layouts (the CPU KV cache stores head-major; a test or device cache row-major),
    and a batch without its per-step decode rows (built where the attention finds them itself)."""
    page_size = 4
    num_pages = sum(-(-(p + n) // page_size) for p, n in MIXED) + 3
    batch = make_step(MIXED, page_size, num_pages, 1, CPU)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch.num_tokens, hq, dk, generator=g)
    rows = num_pages * page_size
    if head_major:
        k_cache = torch.randn(hk, rows, dk, generator=g).transpose(0, 1)
        v_cache = torch.randn(hk, rows, dv, generator=g).transpose(0, 1)
    else:
        k_cache = torch.randn(rows, hk, dk, generator=g)
        v_cache = torch.randn(rows, hk, dv, generator=g)
    ref = sdpa_reference(q, k_cache, v_cache, batch, dk**-0.5)
    got = paged_attention_torch(q, k_cache, v_cache, batch, dk**-0.5)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-6)
    assert batch.decode is not None and len(batch.decode.seqs) == 4
    bare = dataclasses.replace(batch, decode=None, memo={})
    assert torch.equal(paged_attention_torch(q, k_cache, v_cache, bare, dk**-0.5), got)


def test_paged_attention_bf16_close_to_sdpa():
    """bf16 takes HF's three-op score rounding; close to the float64 reference."""
    batch = make_step(MIXED, 4, 40, 2, CPU)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(batch.num_tokens, 4, 16, generator=g).bfloat16()
    k_cache = torch.randn(160, 2, 16, generator=g).bfloat16()
    v_cache = torch.randn(160, 2, 16, generator=g).bfloat16()
    ref = sdpa_reference(q, k_cache, v_cache, batch, 0.25)
    got = paged_attention_torch(q, k_cache, v_cache, batch, 0.25)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), ref, rtol=0.03, atol=0.03)


def test_cpu_kv_cache_is_head_major():
    cfg = ModelConfig.from_dict(
        dict(
            model_type="qwen3_moe",
            vocab_size=32,
            hidden_size=16,
            intermediate_size=32,
            moe_intermediate_size=8,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            num_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=64,
        )
    )
    cache = KVCache(cfg, KVCacheSpec(3, 4), torch.float32, torch.device("cpu"))
    assert cache.k[1].shape == (16, 2, 8) and cache.v[1].shape == (16, 2, 8)
    assert cache.k[1].transpose(0, 1).is_contiguous() and cache.v[1].transpose(0, 1).is_contiguous()


def expert_reference(x, w13, w2, slot_ids, weights) -> torch.Tensor:  # [T, H] float64
    """Per token, per chosen expert, straight from the definition (no batching, float64)."""
    inter = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(slot_ids.shape[1]):
            s = int(slot_ids[t, k])
            if s < 0:
                continue
            gate_up = w13[s].double() @ x[t].double()
            h = F.silu(gate_up[:inter]) * gate_up[inter:]
            out[t] += float(weights[t, k]) * (w2[s].double() @ h)
    return out


def random_moe(t: int, k: int, e: int = 8, h: int = 32, i: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    w13 = torch.randn(e, 2 * i, h, generator=g) * 0.2
    w2 = torch.randn(e, h, i, generator=g) * 0.2
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    ids[0, -1] = -1  # a pair held elsewhere: skipped
    weights = torch.rand(t, k, generator=g)
    return x, w13, w2, ids, weights


@pytest.mark.parametrize("t,k", [(1, 2), (4, 2), (5, 3), (40, 2)])
def test_cpu_experts_match_per_token_reference(t, k):
    x, w13, w2, ids, weights = random_moe(t, k, seed=t * 10 + k)
    ref = expert_reference(x, w13, w2, ids, weights)
    for fn in (gathered_moe, sorted_moe, CPUExpertBackend().forward):
        got = fn(x, w13, w2, ids, weights)
        assert got.dtype == x.dtype and got.shape == x.shape
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)
    # the sorted loop runs the reference's ops per expert: the same numbers
    assert torch.equal(sorted_moe(x, w13, w2, ids, weights, pad=False), torch_moe(x, w13, w2, ids, weights))


def test_cpu_experts_pick_by_budget_and_handle_bf16():
    x, w13, w2, ids, weights = random_moe(6, 2, e=4, h=64, i=32, seed=5)
    per_pair = w13[0].numel() + w2[0].numel()
    assert ids.numel() * per_pair <= GATHER_BUDGET  # a decode-sized step: the gathered path
    ref = expert_reference(x, w13, w2, ids, weights)
    got = CPUExpertBackend().forward(x.bfloat16(), w13.bfloat16(), w2.bfloat16(), ids, weights)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), ref, rtol=0.05, atol=0.05)
    empty = CPUExpertBackend().forward(x[:0], w13, w2, ids[:0], weights[:0])
    assert empty.shape == (0, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_and_rotary_match_hf(dtype):
    """RMSNorm (one op in float32) and the rolled rotary against HF's Qwen3-MoE functions, bit
    for bit."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm, apply_rotary_pos_emb

    g = torch.Generator().manual_seed(7)
    x = (torch.randn(5, 3, 32, generator=g) * 3).to(dtype)
    hf_norm = Qwen3MoeRMSNorm(32, eps=1e-6).to(dtype)
    with torch.no_grad():
        hf_norm.weight.copy_(torch.randn(32, generator=g))
    ours = RMSNorm(32, 1e-6, dtype)
    with torch.no_grad():
        ours.weight.copy_(hf_norm.weight)
    with torch.inference_mode():
        assert torch.equal(ours(x), hf_norm(x))

        rot = Rotary(32, 10000.0)
        positions = torch.tensor([0, 3, 17, 100, 511])
        memo: dict[object, object] = {}
        cos, sin_neg = rot.rolled_tables(positions, dtype, memo)
        assert rot.rolled_tables(positions, dtype, memo)[0] is cos  # made once per step
        c, s = rot.cos_sin(positions, dtype)  # [T, D]
        q_ref, k_ref = apply_rotary_pos_emb(
            x.transpose(0, 1)[None], x.transpose(0, 1)[None], c[None], s[None]
        )
        assert torch.equal(rot.apply_rolled(x, cos, sin_neg), q_ref[0].transpose(0, 1))
        assert torch.equal(rot.apply(x, c, s), k_ref[0].transpose(0, 1))
