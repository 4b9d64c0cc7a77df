"""Fused MoE Triton kernels against a plain-torch reference in float64.

On the CPU the kernels run under TRITON_INTERPRET=1 (set in conftest.py) on small shapes; the
tests marked gpu run real model shapes on a CUDA device, compiled:

    python -m pytest -m gpu tests/test_fused_moe_kernel.py
"""

from __future__ import annotations

import os

import pytest
import torch

from expertmesh.experts import TorchExpertBackend, torch_moe
from gpu_server.backend import TritonExpertBackend, make_backend
from gpu_server.kernels import ConfigTable, GemmConfig, MoeConfig, default_config, fused_moe
from gpu_server.kernels.align import align_pairs
from gpu_server.kernels.reduce import sum_k

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def make_inputs(t, h, inter, s, k, dtype, device="cpu", skip=0.25, seed=0, dead_slot=None):
    """Random experts and routing; ``skip`` of the slots are -1, ``dead_slot`` receives no token."""
    g = torch.Generator().manual_seed(seed)
    gd = torch.Generator(device=device).manual_seed(seed)  # big tensors drawn where they live
    x = torch.randn(t, h, generator=gd, device=device).to(dtype)
    w13 = (torch.randn(s, 2 * inter, h, generator=gd, device=device) / h**0.5).to(dtype)
    w2 = (torch.randn(s, h, inter, generator=gd, device=device) / inter**0.5).to(dtype)
    live = [e for e in range(s) if e != dead_slot]
    # top-k without repeats per token; uneven counts per slot come from the random draw
    choice = torch.stack([torch.randperm(len(live), generator=g)[:k] for _ in range(t)])
    slot_ids = torch.tensor(live)[choice]
    slot_ids[torch.rand(t, k, generator=g) < skip] = -1
    weights = torch.rand(t, k, generator=g)
    return x, w13, w2, slot_ids.to(device), weights.to(device)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any(), "output has NaN (an element was never written)"
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def reference(x, w13, w2, slot_ids, weights) -> torch.Tensor:
    """torch_moe in float64 on the same (already rounded) inputs."""
    return torch_moe(x.double(), w13.double(), w2.double(), slot_ids, weights.double())


def run_poisoned(x, w13, w2, slot_ids, weights, config=None) -> torch.Tensor:
    out = torch.full_like(x, float("nan"))
    return fused_moe(x, w13, w2, slot_ids, weights, config=config, out=out)


# ---------------------------------------------------------------- CPU (interpreter)

SMALL = GemmConfig(block_n=64, block_k=64, num_warps=4, num_stages=2)
UNEVEN_K = GemmConfig(block_n=128, block_k=128, group_m=2)  # 192 % 128 and 320 % 128 != 0


@pytest.mark.parametrize(
    "t,h,inter,s,k,dead",
    [
        (1, 64, 128, 3, 2, None),  # a single token
        (7, 192, 320, 5, 3, 2),  # non-power-of-two sizes, a slot with no tokens
        (13, 128, 192, 4, 2, None),  # uneven tokens per slot, 13*2 pairs over 4 slots
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_matches_reference(t, h, inter, s, k, dead, dtype):
    args = make_inputs(t, h, inter, s, k, dtype, dead_slot=dead, seed=t)
    out = run_poisoned(*args, config=MoeConfig(16, SMALL, SMALL))
    assert out.dtype == dtype and out.shape == (t, h)
    assert rel_err(out, reference(*args)) < TOL[dtype]


@pytest.mark.parametrize("block_m,cfg", [(16, UNEVEN_K), (32, SMALL)])
def test_block_shapes(block_m, cfg):
    """Masked K tails (EVEN_K false), N tiles past I, several blocks per slot."""
    args = make_inputs(40, 192, 320, 3, 2, torch.float32, skip=0.1, seed=3)
    out = run_poisoned(*args, config=MoeConfig(block_m, cfg, cfg))
    assert rel_err(out, reference(*args)) < TOL[torch.float32]


def test_skipped_tokens_are_zero():
    x, w13, w2, slot_ids, weights = make_inputs(6, 64, 128, 4, 2, torch.float32, skip=0.0, seed=5)
    slot_ids[2] = -1  # a token with no local slot
    out = run_poisoned(x, w13, w2, slot_ids, weights, config=MoeConfig(16, SMALL, SMALL))
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    assert rel_err(out, reference(x, w13, w2, slot_ids, weights)) < TOL[torch.float32]
    slot_ids[:] = -1
    out = run_poisoned(x, w13, w2, slot_ids, weights, config=MoeConfig(16, SMALL, SMALL))
    assert torch.equal(out, torch.zeros_like(out))


def test_reduce_ignores_unwritten_rows():
    """Rows of skipped pairs are never written by the down GEMM: garbage there must not leak."""
    g = torch.Generator().manual_seed(4)
    t, k, h = 5, 3, 320
    slot_ids = torch.randint(-1, 2, (t, k), generator=g, dtype=torch.int32)
    y = torch.randn(t * k, h, generator=g)
    y[slot_ids.flatten() < 0] = float("nan")
    out = torch.full((t, h), float("nan"))
    sum_k(y, slot_ids, out)
    ref = torch.where((slot_ids >= 0)[..., None], y.view(t, k, h), 0.0).sum(1)
    torch.testing.assert_close(out, ref)


def test_alignment_invariants():
    g = torch.Generator().manual_seed(11)
    s, k, bm = 6, 3, 16
    slot_ids = torch.randint(-1, s - 1, (37, k), generator=g, dtype=torch.int32)  # slot s-1 empty
    al = align_pairs(slot_ids, s, bm)
    flat = slot_ids.flatten()
    counts = torch.bincount(flat[flat >= 0], minlength=s)
    assert torch.equal(al.slot_count.long(), counts)
    padded = (counts + bm - 1) // bm * bm
    assert torch.equal(al.slot_start.long(), torch.cumsum(padded, 0) - padded)
    for e in range(s):
        lo, n = int(al.slot_start[e]), int(counts[e])
        got = sorted(al.sorted_pairs[lo : lo + n].tolist())
        assert got == torch.where(flat == e)[0].tolist(), f"slot {e}"
        blocks = al.block_slot[lo // bm : (lo + int(padded[e])) // bm]
        assert (blocks == e).all(), f"slot {e}: {blocks}"
    used = int(padded.sum()) // bm
    assert (al.block_slot[used:] == -1).all() and (al.block_slot[:used] >= 0).all()


def test_backends_on_cpu():
    assert isinstance(make_backend("cpu"), TorchExpertBackend)
    args = make_inputs(5, 64, 128, 4, 2, torch.float32, seed=9)
    out = TritonExpertBackend().forward(*args)
    assert rel_err(out, reference(*args)) < TOL[torch.float32]


def test_fit_shared_memory():
    big = MoeConfig(64, GemmConfig(128, 256, num_stages=4), GemmConfig(256, 128, num_stages=5))
    assert big.fitted(2).gate_up.num_stages < 4
    fp32 = big.fitted(4)
    assert fp32.gate_up.num_stages == 2 and fp32.gate_up.block_k == 64
    assert fp32.down.num_stages == 2 and fp32.down.block_k == 64
    small = MoeConfig(16, SMALL, SMALL)
    assert small.fitted(4) == small


def test_config_table_roundtrip(tmp_path):
    cfg = MoeConfig(32, SMALL, UNEVEN_K)
    table = ConfigTable("test gpu", {"H64_I128": {1: default_config(1, 8, 128), 512: cfg}})
    table.save(tmp_path / "t.json")
    loaded = ConfigTable.load(tmp_path / "t.json")
    assert loaded == table
    assert loaded.lookup(64, 128, 400, 8, 128) == cfg  # nearest bucket on a log scale
    assert loaded.lookup(64, 256, 400, 8, 128) == default_config(400, 8, 128)  # untuned shape


# ---------------------------------------------------------------- GPU (real model shapes)


@pytest.fixture
def compiled():
    # interpreted, these would crawl (conftest.py uses the interpreter only without a GPU)
    assert os.environ.get("TRITON_INTERPRET", "0") == "0", "run GPU tests with TRITON_INTERPRET unset or 0"


MODEL_SHAPES = {  # name: (H, I, E, K)
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "deepseek-v2-lite": (2048, 1408, 64, 6),
    "mixtral-8x7b": (4096, 14336, 8, 2),
}


@pytest.mark.gpu
@pytest.mark.parametrize("model", list(MODEL_SHAPES))
def test_gpu_model_shapes(model, compiled):
    h, inter, e, k = MODEL_SHAPES[model]
    backend = make_backend("cuda")
    assert isinstance(backend, TritonExpertBackend)
    for i, t in enumerate((1, 8, 77, 512, 2048)):
        # fresh inputs for every check; a quarter of the slots are elsewhere (-1)
        args = make_inputs(t, h, inter, e, k, torch.bfloat16, device="cuda", seed=100 + i)
        ref = torch_moe(*(a.float() if a.is_floating_point() else a for a in args))
        cfg = backend.table.lookup(h, inter, t, k, e)
        out = run_poisoned(*args, config=cfg)
        err = rel_err(out, ref.double())
        assert err < 1e-2, f"{model} T={t}: {err=}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_gpu_dtypes_and_tuned_configs(dtype, compiled):
    """Every config in this GPU's table, on its own shape, with fresh random inputs."""
    backend = make_backend("cuda")
    buckets = [
        (key, t, c)
        for key, b in sorted(backend.table.shapes.items())
        for t, c in sorted(b.items())
        if t <= 512 or dtype == torch.bfloat16
    ]
    cases = buckets or [("H2048_I768", 64, default_config(64, 8, 128))]
    for seed, (key, t, cfg) in enumerate(cases):
        h, inter = (int(v[1:]) for v in key.split("_"))
        e, k = {768: (128, 8), 1408: (64, 6)}.get(inter, (8, 2))
        args = make_inputs(t + 3, h, inter, e, k, dtype, device="cuda", seed=seed)
        ref = torch_moe(*(a.double() if a.is_floating_point() else a for a in args))
        out = run_poisoned(*args, config=cfg)
        assert rel_err(out, ref) < max(TOL[dtype], 1e-4), f"{key} T={t + 3} {cfg}"
