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
    assert torch.cuda.get_device_capability() >= (8, 9), "needs a GPU with FP8 (sm_89+): the lent H100/H200"
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


def write_fp8_experts(path, block=(16, 16), seed=0):
    """A Qwen3-MoE-shaped checkpoint holding only routed experts, FP8 with block scales (the
    reader needs nothing else); returns its config dict."""
    import json

    from safetensors.torch import save_file

    from tests.hf_models import BASE, CONFIGS

    raw = {**BASE, **CONFIGS["qwen3_moe"], "model_type": "qwen3_moe"}
    raw["quantization_config"] = {"quant_method": "fp8", "weight_block_size": list(block)}
    h, inter = raw["hidden_size"], raw["moe_intermediate_size"]
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in (0, 2):  # layer 1 is dense (mlp_only_layers)
        for e in range(raw["num_experts"]):
            p = f"model.layers.{layer}.mlp.experts.{e}"
            for name, shape in (
                ("gate_proj", (inter, h)),
                ("up_proj", (inter, h)),
                ("down_proj", (h, inter)),
            ):
                q, s = quant.quantize(torch.randn(*shape, generator=g), block)
                tensors[f"{p}.{name}.weight"], tensors[f"{p}.{name}.weight_scale_inv"] = q, s
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(raw))
    return raw


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_fp8_backend_keeps_experts_fp8(tmp_path, device):
    """The GPU server's FP8 path: the slot table holds packed FP8 rows (about a quarter of the
    float32 bytes), the backend computes what torch computes on the dequantised weights."""
    from expertmesh.checkpoint import CheckpointReader
    from expertmesh.experts import torch_moe
    from expertmesh.worker.slots import SlotTable
    from gpu_server.fp8_backend import Fp8TritonBackend, fp8_backend_for

    raw = write_fp8_experts(tmp_path)
    reader = CheckpointReader(tmp_path)
    dev = torch.device(device)
    backend = Fp8TritonBackend(raw["hidden_size"], raw["moe_intermediate_size"], reader.quant)
    if device == "cuda" and torch.cuda.get_device_capability() >= (8, 9):
        assert isinstance(fp8_backend_for(str(tmp_path), device), Fp8TritonBackend)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    slots = SlotTable(
        reader, dtype, dev, 8, read_expert=lambda layer, e: backend.read_expert(reader, layer, e, dev)
    )
    experts = [0, 2, 3, 5, 7]
    slots.preload(experts)
    live = slots.live.layers[2]
    h, inter = raw["hidden_size"], raw["moe_intermediate_size"]
    assert live.w13.dtype == torch.uint8 and live.w13.shape[0] == len(experts)
    assert live.w13.nbytes + live.w2.nbytes < 0.3 * len(experts) * 3 * h * inter * 4
    w13 = torch.stack([reader.expert_weights(2, e).w13 for e in experts]).to(dev)
    w2 = torch.stack([reader.expert_weights(2, e).w2 for e in experts]).to(dev)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, h, generator=g).to(dev, dtype)
    ids = torch.randint(-1, len(experts), (9, 2), generator=g).to(dev)
    w = torch.rand(9, 2, generator=g).to(dev)
    out = backend.forward(x, live.w13, live.w2, ids, w)
    ref = torch_moe(x.double(), w13.double(), w2.double(), ids, w.double())
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < (1e-5 if device == "cpu" else 1e-2), err
    from expertmesh.errors import Unimplemented

    with pytest.raises(Unimplemented, match="LoRA on FP8"):  # never computed without the adapter
        backend.forward(x, live.w13, live.w2, ids, w, lora=object())
