"""MLA's latent KV cache and absorbed attention: the cache layout, the Triton kernel against the
plain-torch absorbed form (interpreter on the CPU, DeepSeek widths on the GPU), and the CUDA
engine against the CPU engine. HF parity of the models themselves is in tests/test_parity.py
and tests/test_rope_scaling.py."""

from __future__ import annotations

import pytest
import torch

from coordinator.model.kernels.mla_attention import mla_attention_triton
from coordinator.model.kv_cache import KVCache, KVCacheSpec
from coordinator.model.models.mla import mla_attention_torch
from expertmesh.config import ModelConfig
from tests.test_attention_kernels import MIXED, make_step, rel_err


def check_kernel(shape, hq, rkv, dr, page_size, dtype, device, seed=0, tol=1e-5, splits=None) -> None:
    num_pages = sum(-(-(p + n) // page_size) for p, n in shape) + 3
    batch = make_step(shape, page_size, num_pages, seed, device)
    g = torch.Generator(device=device).manual_seed(seed)
    t = batch.num_tokens
    q_lat = torch.randn(hq, t, rkv, generator=g, device=device).to(dtype)
    # q_rope as the model hands it over: a strided view of the query projection
    q_rope = torch.randn(t, hq, 3 * dr, generator=g, device=device).to(dtype)[:, :, dr : 2 * dr]
    cache = torch.randn(num_pages * page_size, rkv + dr, generator=g, device=device).to(dtype)
    scale = (rkv // 4 + dr) ** -0.5
    ref = mla_attention_torch(q_lat.double(), q_rope.double(), cache.double(), batch, scale)
    out = torch.full((hq, t, rkv), float("nan"), dtype=dtype, device=device)  # poisoned
    mla_attention_triton(
        q_lat, q_rope, cache, batch.page_table, batch.token_seq, batch.positions, page_size, scale, out=out,
        splits=splits,
    )  # fmt: skip
    assert not out.isnan().any()
    assert rel_err(out, ref) < tol, rel_err(out, ref)


@pytest.mark.parametrize("hq,rkv,dr", [(4, 24, 8), (20, 32, 16)])  # one head block; two, the last partial
@pytest.mark.parametrize("splits", [1, 4])  # 4: sequences cut in parts (some empty), then merged
def test_kernel_matches_torch_cpu(hq, rkv, dr, splits):
    check_kernel(
        MIXED, hq, rkv, dr, page_size=4, dtype=torch.float32, device=torch.device("cpu"), splits=splits
    )


@pytest.mark.parametrize("splits", [1, 2])
def test_padding_token_gets_zeros_cpu(splits):
    batch = make_step([(2, 1)], 4, 2, 0, torch.device("cpu"))
    q_lat, q_rope, cache = torch.randn(3, 2, 16), torch.randn(2, 3, 8), torch.randn(8, 24)
    out = torch.full((3, 2, 16), float("nan"))
    pos, seq = torch.tensor([2, -1]), torch.tensor([0, 0], dtype=torch.int32)
    mla_attention_triton(q_lat, q_rope, cache, batch.page_table, seq, pos, 4, 1.0, out=out, splits=splits)
    assert out[:, 1].eq(0).all() and not out[:, 0].isnan().any()


# deepseek_v2: merged q/kv_a projection, float32 rotary; V3's query latent runs on the GPU test
@pytest.mark.parametrize("arch", ["deepseek_v2"])
def test_triton_path_matches_torch_path_cpu(arch, tmp_path):
    """The CUDA code path of MLAttention (fused rope/norm/store, absorbed bmm's, the latent
    kernel), run under the interpreter, against the plain-torch path on the same checkpoint:
    a mixed prefill, decode steps, and an extend over a cached prefix beside a decode row."""
    from coordinator.model.engine import Engine
    from coordinator.model.models.mla import MLAttention
    from tests.hf_models import make_checkpoint

    make_checkpoint(arch, tmp_path)
    engines = [Engine.from_checkpoint(str(tmp_path), dtype=torch.float32, page_size=4) for _ in range(2)]
    mods = [m for m in engines[1].model.modules() if isinstance(m, MLAttention)]
    assert mods
    for m in mods:
        m.triton_on_cpu = True
    prompts = [[(7 * i + j) % 96 for j in range(n)] for i, n in enumerate((11, 5))]
    outs = []
    for eng in engines:
        ids = [eng.new_seq() for _ in prompts]
        got = eng.step([(s, p) for s, p in zip(ids, prompts)], all_logits=True)
        for _ in range(2):
            got += eng.step([(s, [3]) for s in ids])
        got += eng.step([(ids[0], [4, 5]), (ids[1], [6])], all_logits=True)
        outs.append(got)
    for a, b in zip(*outs, strict=True):
        assert rel_err(b, a) < 1e-5, rel_err(b, a)


def v2_lite_config() -> ModelConfig:
    return ModelConfig.from_dict(
        dict(model_type="deepseek_v2", vocab_size=102400, hidden_size=2048, intermediate_size=10944,
             num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None,
             kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
             n_routed_experts=64, num_experts_per_tok=6, moe_intermediate_size=1408, n_shared_experts=2,
             first_k_dense_replace=1, topk_method="greedy", rms_norm_eps=1e-6)
    )  # fmt: skip


def test_latent_cache_layout():
    """DeepSeek-V2-Lite: 576 cached values per token per layer instead of 16 heads x (192 + 128);
    values are a view of the latent part of the key rows (stored once)."""
    cfg = v2_lite_config()
    assert KVCacheSpec.values_per_token(cfg) == 512 + 64
    assert KVCacheSpec.bytes_per_page(cfg, 16, torch.bfloat16) == 576 * 27 * 16 * 2
    cache = KVCache(cfg, KVCacheSpec(num_pages=2, page_size=4), torch.bfloat16, torch.device("meta"))
    assert cache.k.shape == (27, 12, 1, 576) and cache.v.shape == (27, 12, 1, 512)
    assert cache.v.data_ptr() == cache.k.data_ptr() and cache.v.stride() == cache.k.stride()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_deepseek_widths_gpu(dtype):
    dev = torch.device("cuda")
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    # DeepSeek-V2-Lite: 16 heads, latent 512 + rope 64; 16 decode rows, a prefill and an extend
    shape = [(int(s), 1) for s in torch.randint(1, 700, (16,), generator=torch.Generator().manual_seed(1))]
    shape += [(0, 77), (129, 33)]
    check_kernel(shape, 16, 512, 64, page_size=16, dtype=dtype, device=dev, tol=tol)
    check_kernel(shape[:1], 16, 512, 64, page_size=16, dtype=dtype, device=dev, tol=tol)  # batch 1: 16 splits
    check_kernel(shape[:4], 16, 512, 64, page_size=16, dtype=dtype, device=dev, tol=tol, splits=1)
    # DeepSeek-V3 / Kimi-K2 head counts (128 / 64 heads: several head blocks per token)
    check_kernel([(40, 1), (0, 19), (300, 1)], 128, 512, 64, page_size=16, dtype=dtype, device=dev, tol=tol)
    check_kernel([(5, 1), (200, 1)], 64, 512, 64, page_size=16, dtype=dtype, device=dev, tol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_cuda_engine_matches_cpu_mla(arch, tmp_path):
    """The CUDA engine (absorbed kernel for every step, decode graphs) against the CPU engine
    (absorbed decode, decompressed prefill) on the same latent-cache checkpoint, float32."""
    from coordinator.model.engine import Engine
    from tests.hf_models import make_checkpoint

    make_checkpoint(arch, tmp_path)
    cpu = Engine.from_checkpoint(str(tmp_path), dtype=torch.float32, page_size=4)
    gpu = Engine.from_checkpoint(str(tmp_path), dtype=torch.float32, device="cuda", page_size=4)
    assert gpu.graphs is not None

    def err(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a.cpu() - b).abs().max() / b.abs().max()).item()

    prompts = [[(7 * i + j) % 96 for j in range(n)] for i, n in enumerate((11, 5, 9))]
    ids = {e: [e.new_seq() for _ in prompts] for e in (cpu, gpu)}
    steps = {e: e.step([(s, p) for s, p in zip(ids[e], prompts)], all_logits=True) for e in (cpu, gpu)}
    for a, b in zip(steps[gpu], steps[cpu]):
        assert err(a, b) < 2e-3
    toks = [int(x[-1].argmax()) for x in steps[cpu]]
    for _ in range(6):  # batch 3 replays bucket 4 (one padding row)
        out = {e: e.step([(s, [t]) for s, t in zip(ids[e], toks)]) for e in (cpu, gpu)}
        for a, b in zip(out[gpu], out[cpu]):
            assert err(a, b) < 2e-3
        toks = [int(x.argmax()) for x in out[cpu]]
    # an extend over a cached prefix in a mixed step (two new tokens + one decode row)
    out = {e: e.step([(ids[e][0], toks[:2]), (ids[e][1], [toks[1]])], all_logits=True) for e in (cpu, gpu)}
    for a, b in zip(out[gpu], out[cpu]):
        assert err(a, b) < 2e-3


@pytest.mark.gpu
def test_cuda_engine_lora_on_kv_b_proj_gpu(tmp_path):
    """LoRA on kv_b_proj (absorbed into q_lat and the output on CUDA, folded into the weight on
    the CPU) and on the other MLA projections: CUDA engine vs CPU engine, adapter and base rows."""
    from coordinator.lora import enable_lora
    from coordinator.model.engine import Engine
    from tests import lora_utils

    hf = lora_utils.make_model("deepseek_v3", tmp_path / "model")
    lora_utils.save(lora_utils.wrap(hf, seed=1), tmp_path / "ad")
    engines = []
    for dev in ("cpu", "cuda"):
        eng = Engine.from_checkpoint(str(tmp_path / "model"), dtype=torch.float32, device=dev, page_size=4)
        enable_lora(eng, max_loras=2).load("ad", str(tmp_path / "ad"))
        engines.append(eng)
    prompt = [(5 * j + 3) % 96 for j in range(7)]
    outs = []
    for eng in engines:
        seqs = [eng.new_seq(), eng.new_seq()]
        full = eng.step([(s, prompt) for s in seqs], all_logits=True, adapters=[None, "ad"])
        toks = [int(full[0][-1].argmax()), int(full[1][-1].argmax())]
        steps = [eng.step([(s, [t]) for s, t in zip(seqs, toks)], adapters=[None, "ad"]) for _ in range(1)]
        outs.append([x.cpu() for x in full] + [x.cpu() for x in steps[0]])
    cpu, gpu = outs
    assert ((cpu[1] - cpu[0]).abs().max() / cpu[0].abs().max()).item() > 1e-2, "the adapter barely acts"
    for a, b in zip(gpu, cpu):
        assert ((a - b).abs().max() / b.abs().max()).item() < 2e-3
