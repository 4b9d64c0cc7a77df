"""MoE-LoRA Triton kernels against the plain-torch reference (float64), and that reference
against a per-token loop written straight from the formula.

CPU: TRITON_INTERPRET=1 (conftest.py), small shapes. GPU (marked): bf16 at real widths,
Qwen3-30B-A3B (H2048 I768 E128 top8) and DeepSeek-V2-Lite (H2048 I1408 E64 top6), ranks
8/16/64, 1-4 adapters mixed with base tokens:

    python -m pytest -m gpu tests/test_lora_kernel.py
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from expertmesh.lora import ExpertLoRA, MoELoRAWeights, moe_lora_reference
from gpu_server.kernels import GemmConfig, MoeConfig
from gpu_server.kernels.moe_lora import fused_moe_lora
from tests.test_fused_moe_kernel import make_inputs, rel_err


def make_lora(num_adapters, s, h, inter, r13, r2, dtype, device="cpu", seed=0, scale=1.0) -> MoELoRAWeights:
    g = torch.Generator(device=device).manual_seed(seed + 100)
    adapters = []
    for _ in range(num_adapters):
        adapters.append(
            ExpertLoRA(
                torch.randn(s, r13, h, generator=g, device=device) / h**0.5,
                torch.randn(s, 2 * inter, r13, generator=g, device=device) * scale / r13**0.5,
                torch.randn(s, r2, inter, generator=g, device=device) / inter**0.5,
                torch.randn(s, h, r2, generator=g, device=device) * scale / r2**0.5,
            )
        )
    w = MoELoRAWeights.stack(adapters)
    return MoELoRAWeights(*(t.to(dtype) for t in (w.a13, w.b13, w.a2, w.b2)))


def token_adapters(t, num_adapters, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed + 7)
    return torch.randint(-1, num_adapters, (t,), generator=g).to(device)  # -1 = base tokens mixed in


def loop_reference(x, w13, w2, slot_ids, weights, lora, token_adapter):
    """One token and one k at a time, straight from the formula (float64)."""
    inter = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        a = int(token_adapter[t])
        for k in range(slot_ids.shape[1]):
            s = int(slot_ids[t, k])
            if s < 0:
                continue
            xt = x[t].double()
            gu = w13[s].double() @ xt
            if a >= 0:
                gu = gu + lora.b13[a, s].double() @ (lora.a13[a, s].double() @ xt)
            hmid = F.silu(gu[:inter]) * gu[inter:]
            y = w2[s].double() @ hmid
            if a >= 0:
                y = y + lora.b2[a, s].double() @ (lora.a2[a, s].double() @ hmid)
            out[t] += weights[t, k].double() * y
    return out


def reference64(x, w13, w2, slot_ids, weights, lora, token_adapter):
    d = MoELoRAWeights(*(t.double() for t in (lora.a13, lora.b13, lora.a2, lora.b2)))
    return moe_lora_reference(
        x.double(), w13.double(), w2.double(), slot_ids, weights.double(), d, token_adapter
    )


def test_reference_matches_formula():
    x, w13, w2, slot_ids, weights = make_inputs(9, 32, 24, 5, 2, torch.float32)
    lora = make_lora(3, 5, 32, 24, 6, 4, torch.float32)
    ta = token_adapters(9, 3)
    got = reference64(x, w13, w2, slot_ids, weights, lora, ta)
    assert rel_err(got, loop_reference(x, w13, w2, slot_ids, weights, lora, ta)) < 1e-12
    # the LoRA is not negligible, and base tokens are untouched by it
    base = moe_lora_reference(x.double(), w13.double(), w2.double(), slot_ids, weights.double())
    assert (got - base)[ta >= 0].abs().max() > 0.05 * base.abs().max()
    assert torch.equal(got[ta < 0], base[ta < 0])


SMALL = MoeConfig(
    16, GemmConfig(block_n=32, block_k=32, num_stages=2), GemmConfig(block_n=32, block_k=32, num_stages=2)
)
UNEVEN = MoeConfig(
    16, GemmConfig(block_n=64, block_k=64, num_stages=2), GemmConfig(block_n=64, block_k=64, num_stages=2)
)


@pytest.mark.parametrize(
    "t,h,inter,s,k,adapters,r13,r2,cfg",
    [
        (7, 64, 48, 6, 2, 3, 8, 20, SMALL),  # ranks below and above 16 (padded tile)
        (12, 96, 40, 5, 3, 1, 16, 16, UNEVEN),  # H and I not multiples of block_k
    ],
)
@pytest.mark.parametrize("strategy", ["inloop", "split"])
def test_kernel_matches_reference_cpu(t, h, inter, s, k, adapters, r13, r2, cfg, strategy):
    x, w13, w2, slot_ids, weights = make_inputs(t, h, inter, s, k, torch.float32)
    lora = make_lora(adapters, s, h, inter, r13, r2, torch.float32)
    ta = token_adapters(t, adapters)
    nan = torch.full_like(x, float("nan"))
    out = fused_moe_lora(x, w13, w2, slot_ids, weights, lora, ta, config=cfg, out=nan, strategy=strategy)
    assert rel_err(out, reference64(x, w13, w2, slot_ids, weights, lora, ta)) < 1e-5


# ---------------------------------------------------------------- GPU (real widths, bf16)

REAL = {"qwen3_30b_a3b": (2048, 768, 128, 8), "deepseek_v2_lite": (2048, 1408, 64, 6)}


@pytest.mark.gpu
@pytest.mark.parametrize("rank", [8, 16, 64])
@pytest.mark.parametrize("num_adapters", [1, 4])
@pytest.mark.parametrize("model", list(REAL))
@pytest.mark.parametrize("t,strategy", [(1, "auto"), (64, "inloop"), (64, "split"), (512, "auto")])
def test_kernel_matches_reference_gpu(model, rank, num_adapters, t, strategy):
    h, inter, s, k = REAL[model]
    dev = "cuda"
    x, w13, w2, slot_ids, weights = make_inputs(t, h, inter, s, k, torch.bfloat16, device=dev, skip=0.1)
    # separate gate/up A matrices stack to rank 2r for gate_up
    lora = make_lora(num_adapters, s, h, inter, 2 * rank, rank, torch.bfloat16, device=dev)
    ta = token_adapters(t, num_adapters, device=dev)
    nan = torch.full_like(x, float("nan"))
    out = fused_moe_lora(x, w13, w2, slot_ids, weights, lora, ta, out=nan, strategy=strategy)
    # float64 on the device: same rounded inputs, exact-enough products
    assert rel_err(out, reference64(x, w13, w2, slot_ids, weights, lora, ta)) < 1e-2
