"""The paged-attention Triton kernel against the plain-torch path (interpreter on the CPU, real
shapes on the GPU), for decode, prefill and extend-with-a-cached-prefix in one step."""

from __future__ import annotations

import random

import pytest
import torch

from coordinator.model.batch import ForwardBatch
from coordinator.model.kernels.paged_attention import paged_attention_triton
from coordinator.model.models.attention import paged_attention_torch


def make_step(
    shape: list[tuple[int, int]], page_size: int, num_pages: int, seed: int, device: torch.device
) -> ForwardBatch:
    """shape: (tokens already cached, new tokens) per sequence; pages are shuffled over the pool."""
    rng = random.Random(seed)
    free = list(range(num_pages))
    rng.shuffle(free)
    seqs = []
    for past, new in shape:
        need = -(-(past + new) // page_size)
        pages, free = free[:need], free[need:]
        seqs.append(([rng.randrange(50) for _ in range(new)], past, pages))
    return ForwardBatch.build(seqs, page_size, device)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def check(shape, hq, hk, dk, dv, page_size, dtype, device, seed=0, tol=1e-5) -> None:
    num_pages = sum(-(-(p + n) // page_size) for p, n in shape) + 3
    batch = make_step(shape, page_size, num_pages, seed, device)
    g = torch.Generator(device=device).manual_seed(seed)
    t = batch.num_tokens
    q = torch.randn(t, hq, dk, generator=g, device=device).to(dtype)
    k_cache = torch.randn(num_pages * page_size, hk, dk, generator=g, device=device).to(dtype)
    v_cache = torch.randn(num_pages * page_size, hk, dv, generator=g, device=device).to(dtype)
    ref = paged_attention_torch(q.double(), k_cache.double(), v_cache.double(), batch, dk**-0.5)
    out = torch.full((t, hq, dv), float("nan"), dtype=dtype, device=device)  # poisoned
    paged_attention_triton(
        q, k_cache, v_cache, batch.page_table, batch.token_seq, batch.positions, page_size, dk**-0.5, out=out
    )
    assert not out.isnan().any()
    assert rel_err(out, ref) < tol, rel_err(out, ref)


# (cached, new) per sequence: decode rows, a fresh prefill and an extend over a cached prefix
MIXED = [(0, 5), (7, 1), (3, 6), (20, 1), (0, 1)]


@pytest.mark.parametrize(
    "hq,hk,dk,dv",
    [(4, 2, 16, 16), (4, 4, 24, 12), (6, 1, 8, 8)],  # GQA, MLA-like (Dk != Dv, not powers of 2), MQA
)
def test_kernel_matches_torch_cpu(hq, hk, dk, dv):
    check(MIXED, hq, hk, dk, dv, page_size=4, dtype=torch.float32, device=torch.device("cpu"))


def test_padding_token_gets_zeros_cpu():
    dev = torch.device("cpu")
    batch = make_step([(2, 1)], 4, 2, 0, dev)
    q = torch.randn(2, 2, 8)
    kv = torch.randn(8, 1, 8)
    out = torch.full((2, 2, 8), float("nan"))
    pos = torch.tensor([2, -1])
    seq = torch.tensor([0, 0], dtype=torch.int32)
    paged_attention_triton(q, kv, kv, batch.page_table, seq, pos, 4, 1.0, out=out)
    assert out[1].eq(0).all() and not out[0].isnan().any()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_real_shapes_gpu(dtype):
    dev = torch.device("cuda")
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    # Qwen3-30B-A3B attention: 32 query / 4 KV heads of 128; 16 decode rows + a prefill + an extend
    shape = [(int(s), 1) for s in torch.randint(1, 700, (16,), generator=torch.Generator().manual_seed(1))]
    shape += [(0, 77), (129, 33)]
    check(shape, 32, 4, 128, 128, page_size=16, dtype=dtype, device=dev, tol=tol)
    # DeepSeek MLA as cached today: 16 heads, K 192, V 128
    check([(40, 1), (0, 19), (300, 1)], 16, 16, 192, 128, page_size=16, dtype=dtype, device=dev, tol=tol)
