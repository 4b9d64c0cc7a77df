"""The fused Triton ops of the decoder layer against the plain-torch path they replace
(interpreter on the CPU, bf16 at real widths on the GPU)."""

from __future__ import annotations

import pytest
import torch

from coordinator.model.kernels.fused_ops import mla_rope_store, qk_norm_rope_store, rmsnorm, softmax_topk
from coordinator.model.models.layers import RMSNorm, Rotary
from coordinator.model.router import RouterSpec, route
from expertmesh.config import RopeScaling

# Qwen3's long-context setting (yarn factor 4) over a short original window, so that the
# positions below are past it; attention factor 0.1 ln 4 + 1 = 1.139
YARN = RopeScaling("yarn", 4.0, original_max_position_embeddings=64)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def check_rmsnorm(t, n, dtype, device, tol):
    norm = RMSNorm(n, 1e-6, dtype).to(device)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(t, n, device=device).to(dtype)
    r = torch.randn(t, n, device=device).to(dtype)
    ref_x = (x.cpu() + r.cpu()).float()
    ref = RMSNorm.forward(norm.cpu(), (x.cpu() + r.cpu()))  # the torch path (CPU)
    x_out, y = rmsnorm(x, norm.weight.to(device), 1e-6, residual=r)
    assert rel_err(x_out.cpu(), ref_x) < tol and rel_err(y.cpu(), ref) < tol
    _, y2 = rmsnorm(x, norm.weight.to(device), 1e-6)
    assert rel_err(y2.cpu(), RMSNorm.forward(norm.cpu(), x.cpu())) < tol


def check_qk_rope(t, hq, hk, d, dtype, device, with_norm, tol, scaling=None):
    g = torch.Generator().manual_seed(t + d)
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=g).to(dtype)
    pos = torch.randint(0, 4000, (t,), generator=g)
    rows = torch.randperm(3 * t, generator=g)[:t]
    qn, kn = RMSNorm(d, 1e-6, dtype), RMSNorm(d, 1e-6, dtype)
    with torch.no_grad():
        qn.weight.uniform_(0.5, 1.5)
        kn.weight.uniform_(0.5, 1.5)
    rot = Rotary(d, 1e6, scaling=scaling)
    assert (rot.factor != 1.0) == (scaling is not None)
    # reference: the plain-torch Attention steps
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    q, k, v = q.view(t, hq, d), k.view(t, hk, d), v.view(t, hk, d)
    if with_norm:
        q, k = qn(q), kn(k)
    cos, sin = rot.cos_sin(pos, dtype)
    q, k = rot.apply(q, cos, sin), rot.apply(k, cos, sin)
    k_cache = torch.full((3 * t, hk, d), float("nan"), dtype=dtype, device=device)
    v_cache = torch.full((3 * t, hk, d), float("nan"), dtype=dtype, device=device)
    norms = (qn.weight.to(device), kn.weight.to(device), 1e-6) if with_norm else None
    q_out = qk_norm_rope_store(
        qkv.to(device), hq, hk, pos.to(device), rows.to(device), rot.inv_freq(torch.device(device)),
        k_cache, v_cache, norms, rot.factor,
    )  # fmt: skip
    assert rel_err(q_out.cpu(), q) < tol
    assert rel_err(k_cache.cpu()[rows], k) < tol
    assert torch.equal(v_cache.cpu()[rows], v)


def check_mla_rope(t, hq, dn, dr, rkv, dtype, device, interleave, rope_in_float32, tol, scaling=None):
    """mla_rope_store against MLAttention's torch steps: latent norm, rotary of q and the shared
    key part (pairs or halves, float32 or activation-dtype rounding), the cache row written."""
    from types import SimpleNamespace

    from coordinator.model.models.mla import MLAttention

    g = torch.Generator().manual_seed(t + dr)
    q = torch.randn(t, hq, dn + dr, generator=g).to(dtype)
    kv_a = torch.randn(t, rkv + dr, generator=g).to(dtype)
    pos = torch.randint(0, 4000, (t,), generator=g)
    rows = torch.randperm(3 * t, generator=g)[:t]
    norm = RMSNorm(rkv, 1e-6, dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    rot = Rotary(dr, 1e4, interleave=interleave, scaling=scaling)
    me = SimpleNamespace(rotary=rot, rope_in_float32=rope_in_float32)
    q_rope, k_rope = MLAttention._rotate(me, q[..., dn:], kv_a[:, None, rkv:], pos)  # type: ignore[arg-type]
    ref_row = torch.cat([RMSNorm.forward(norm, kv_a[:, :rkv]), k_rope[:, 0]], dim=-1)  # [T, Rkv+Dr]
    cache = torch.full((3 * t, rkv + dr), float("nan"), dtype=dtype, device=device)
    got = mla_rope_store(
        q.to(device), kv_a.to(device), pos.to(device), rows.to(device), rot.inv_freq(torch.device(device)),
        (norm.weight.to(device), 1e-6), cache, interleave, rope_in_float32, rot.factor,
    )  # fmt: skip
    assert rel_err(got.cpu(), q_rope) < tol, rel_err(got.cpu(), q_rope)
    assert rel_err(cache.cpu()[rows], ref_row) < tol, rel_err(cache.cpu()[rows], ref_row)


def check_topk(t, e, k, dtype, device):
    spec = RouterSpec(top_k=k, norm_topk_prob=True, routed_scaling_factor=1.5, round_weights=True)
    # distinct logits, exact in bf16: ties would let either implementation pick either expert
    logits = (torch.stack([torch.randperm(e) for _ in range(t)]).float() / 16).to(dtype)
    ref_ids, ref_w = route(logits, spec)
    ids, w = softmax_topk(logits.to(device), k, True, 1.5, True)
    assert torch.equal(ids.cpu(), ref_ids)
    # bf16 weights may round one ulp apart when the float32 values differ in their last bits
    tol = 1e-6 if dtype == torch.float32 else 8e-3
    assert torch.allclose(w.cpu(), ref_w, rtol=tol, atol=0)


def test_rmsnorm_cpu():
    check_rmsnorm(3, 48, torch.float32, "cpu", 1e-6)


@pytest.mark.parametrize("with_norm", [True, False])
@pytest.mark.parametrize("scaling", [None, YARN], ids=["plain", "yarn"])
def test_qk_norm_rope_store_cpu(with_norm, scaling):
    check_qk_rope(3, 4, 2, 16, torch.float32, "cpu", with_norm, 1e-6, scaling)


@pytest.mark.parametrize("interleave,f32", [(True, True), (False, False)], ids=["v2", "v3-halves"])
@pytest.mark.parametrize("scaling", [None, YARN], ids=["plain", "yarn"])
def test_mla_rope_store_cpu(interleave, f32, scaling):
    check_mla_rope(3, 4, 16, 8, 24, torch.float32, "cpu", interleave, f32, 1e-6, scaling)


def test_softmax_topk_cpu():
    check_topk(5, 24, 3, torch.float32, "cpu")


@pytest.mark.gpu
def test_fused_ops_real_widths_gpu():
    check_rmsnorm(64, 2048, torch.bfloat16, "cuda", 1e-2)
    check_qk_rope(64, 32, 4, 128, torch.bfloat16, "cuda", True, 1e-2)
    check_qk_rope(7, 32, 4, 128, torch.float32, "cuda", True, 1e-5)
    check_qk_rope(64, 32, 4, 128, torch.bfloat16, "cuda", True, 1e-2, YARN)
    check_qk_rope(7, 32, 4, 128, torch.float32, "cuda", True, 1e-5, YARN)
    # DeepSeek-V2-Lite / V3 widths: 16 / 128 heads, Dn 128, Dr 64, latent 512
    check_mla_rope(64, 16, 128, 64, 512, torch.bfloat16, "cuda", True, True, 1e-2)
    check_mla_rope(64, 128, 128, 64, 512, torch.bfloat16, "cuda", True, False, 1e-2, YARN)
    check_mla_rope(7, 16, 128, 64, 512, torch.float32, "cuda", False, True, 1e-5, YARN)
    check_topk(64, 128, 8, torch.bfloat16, "cuda")
    check_topk(64, 60, 4, torch.float32, "cuda")


@pytest.mark.gpu
def test_yarn_attention_takes_fused_path_gpu(monkeypatch):
    """Qwen3 attention with YaRN (head dim 64) on CUDA goes through the fused kernel and matches
    the plain-torch CPU path of the same module, float32, positions past the original window."""
    from coordinator.model.kv_cache import KVCache, KVCacheSpec
    from coordinator.model.models.attention import Attention
    from expertmesh.config import ModelConfig
    from tests.hf_models import BASE, CONFIGS
    from tests.test_attention_kernels import make_step

    rs = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=8)
    raw = {**BASE, **CONFIGS["qwen3_moe"], "model_type": "qwen3_moe", "head_dim": 64, "rope_scaling": rs}
    cfg = ModelConfig.from_dict(raw)
    attn = Attention(cfg, 0, torch.float32)
    with torch.no_grad():
        for name, p in attn.named_parameters():
            p.copy_(torch.rand_like(p) + 0.5 if "norm" in name else torch.randn_like(p) * 0.1)
    assert attn.rotary.factor > 1.1
    shape = [(0, 5), (17, 1), (9, 6), (40, 1)]
    calls: list[str] = []
    fused = Attention._forward_fused
    monkeypatch.setattr(
        Attention, "_forward_fused", lambda self, *a: calls.append("fused") or fused(self, *a)
    )
    outs = []
    for dev in ("cpu", "cuda"):
        d = torch.device(dev)
        attn = attn.to(d)
        batch = make_step(shape, 4, 32, 0, d)
        cache = KVCache(cfg, KVCacheSpec(32, 4), torch.float32, d)
        x = torch.randn(batch.num_tokens, cfg.hidden_size, generator=torch.Generator().manual_seed(2)).to(d)
        outs.append(attn(x, batch, (cache.k[0], cache.v[0])).cpu())
    assert calls == ["fused"]  # the CUDA call only
    assert rel_err(outs[1], outs[0]) < 1e-5, rel_err(outs[1], outs[0])


@pytest.mark.parametrize("t,k,s,bm", [(1, 8, 128, 16), (37, 3, 6, 16), (64, 8, 128, 16)])
def test_align_one_program_matches_three_launches(t, k, s, bm):
    """The decode-size alignment (one program) against the three-launch one: same counts,
    starts and block map, and each slot's rows hold the same pairs."""
    from gpu_server.kernels.align import align_pairs

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(t)
    ids = torch.randint(-1, s, (t, k), generator=g, dtype=torch.int32).to(dev)
    one, three = align_pairs(ids, s, bm, one_program=True), align_pairs(ids, s, bm, one_program=False)
    for name in ("slot_count", "slot_start", "block_slot"):
        assert torch.equal(getattr(one, name), getattr(three, name)), name
    for e in range(s):
        lo, n = int(three.slot_start[e]), int(three.slot_count[e])
        assert sorted(one.sorted_pairs[lo : lo + n].tolist()) == sorted(
            three.sorted_pairs[lo : lo + n].tolist()
        )


def _compiled_variants(kernel) -> int:
    """How many variants of a Triton kernel this process has compiled (every device)."""
    return sum(len(cache[0]) for cache in kernel.device_caches.values())


@pytest.mark.gpu
def test_align_compiles_no_variant_per_slot_count_gpu():
    """A placement change gives layers new slot counts (an EPLB move: 96 -> 66, 67, ...): the
    alignment must not compile a new kernel variant for each, since that happens inside a step."""
    from gpu_server.kernels import align

    def run(s: int, t: int) -> None:
        ids = torch.randint(-1, s, (t, 8), dtype=torch.int32, device="cuda")
        al = align.align_pairs(ids, s, 16)
        ref = torch.bincount(ids[ids >= 0].long(), minlength=s)
        assert torch.equal(al.slot_count.long().cpu(), ref.cpu())

    counts = (96, 66, 67, 101, 80, 112, 65)
    for t in (16, 256):  # one program at decode sizes, three launches past them
        run(counts[0], t)
        kernels = (
            align._align_one_program_kernel,
            align._count_kernel,
            align._map_kernel,
            align._scatter_kernel,
        )
        before = [_compiled_variants(k) for k in kernels]
        for s in counts[1:]:
            run(s, t)
        assert [_compiled_variants(k) for k in kernels] == before, t
