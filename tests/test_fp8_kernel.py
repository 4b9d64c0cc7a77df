"""The FP8 block-scaled fused-MoE kernel against torch dequantise-then-matmul: in the Triton
interpreter on small shapes, and on a GPU with FP8 at DeepSeek-V3 widths:

    python -m pytest -m gpu tests/test_fp8_kernel.py
"""

from __future__ import annotations

import pytest
import torch

from expertmesh import quant


def dequant_reference(x, q13, s13, q2, s2, slot_ids, weights, block) -> torch.Tensor:
    """torch: dequantise each used expert to float32, then its two matmuls; float32 out."""
    out = torch.zeros(x.shape[0], q2.shape[1], dtype=torch.float32, device=x.device)
    inter = q2.shape[2]
    xf = x.float()
    for e in torch.unique(slot_ids[slot_ids >= 0]).tolist():
        tok, kk = (slot_ids == e).nonzero(as_tuple=True)
        w13 = quant.dequantize(q13[e], s13[e], block)
        w2 = quant.dequantize(q2[e], s2[e], block)
        gu = xf[tok] @ w13.T
        act = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
        out.index_add_(0, tok, (act @ w2.T) * weights[tok, kk, None].float())
    return out


def make_fp8_experts(t, h, inter, s, k, block, dtype, device, seed=0, skip=0.2):
    gd = torch.Generator(device=device).manual_seed(seed)
    q13, s13, q2, s2 = [], [], [], []
    for _ in range(s):  # one expert at a time: DeepSeek-V3 widths in bf16 would not fit twice
        w13 = torch.randn(2 * inter, h, generator=gd, device=device) / h**0.5
        w2 = torch.randn(h, inter, generator=gd, device=device) / inter**0.5
        a, b = quant.quantize(w13, block)
        c, d = quant.quantize(w2, block)
        q13.append(a), s13.append(b), q2.append(c), s2.append(d)
    x = torch.randn(t, h, generator=gd, device=device).to(dtype)
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(s, generator=g)[:k] for _ in range(t)])
    ids[torch.rand(t, k, generator=g) < skip] = -1
    w = torch.rand(t, k, generator=g)
    return (
        x,
        torch.stack(q13),
        torch.stack(s13),
        torch.stack(q2),
        torch.stack(s2),
        ids.to(device),
        w.to(device),
    )


def test_fp8_kernel_interpreter():
    """Weight-only FP8 in the interpreter, fp32 activations: H=80 is not a multiple of the 32-wide
    scale block (a partial K block and EVEN_K off)."""
    from gpu_server.kernels import GemmConfig, MoeConfig
    from gpu_server.kernels.fp8_moe import fused_moe_fp8

    block = (32, 32)
    x, q13, s13, q2, s2, ids, w = make_fp8_experts(7, 80, 64, 4, 2, block, torch.float32, "cpu")
    cfg = MoeConfig(16, GemmConfig(32, 32, 1, 4, 2), GemmConfig(32, 64, 1, 4, 2))
    out = torch.full_like(x, float("nan"))
    fused_moe_fp8(x, q13, s13, q2, s2, ids, w, block, config=cfg, out=out)
    ref = dequant_reference(x, q13, s13, q2, s2, ids, w, block)
    assert not out.isnan().any()
    assert ((out - ref).norm() / ref.norm()).item() < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("act_fp8", [False, True], ids=["w8a16", "w8a8"])
def test_fp8_kernel_deepseek_v3_widths(act_fp8):
    """DeepSeek-V3 routed experts (H 7168, I 2048, 256 experts, top-8, 128x128 blocks), bf16
    activations, against torch dequantise-then-matmul in float32. Bounds: w8a16 rounds only the
    bf16 intermediate and output (the weights are exact), the same 1e-2 as the bf16 kernel's
    test; w8a8 also rounds each activation to e4m3 (3 mantissa bits, <= 2^-4 relative each,
    ~2-3% in norm over a layer's two products), so 6e-2."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a GPU with FP8 (sm_89+)")
    from gpu_server.kernels.fp8_moe import fused_moe_fp8

    block = (128, 128)
    x, q13, s13, q2, s2, ids, w = make_fp8_experts(512, 7168, 2048, 256, 8, block, torch.bfloat16, "cuda")
    for t in (1, 37, 512):
        args = (x[:t], q13, s13, q2, s2, ids[:t], w[:t])
        out = torch.full_like(x[:t], float("nan"))
        fused_moe_fp8(*args, block=block, act_fp8=act_fp8, out=out)
        ref = dequant_reference(*args, block)
        err = ((out.float() - ref).norm() / ref.norm()).item()
        assert not out.isnan().any() and err < (6e-2 if act_fp8 else 1e-2), f"T={t} {err=}"
