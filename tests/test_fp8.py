"""FP8 block-quantised checkpoints (DeepSeek-V3 / Qwen3-FP8 layout) and the FP8 fused-MoE kernel.

Checkpoints: a tiny HF model is written, then quantised here the way those checkpoints are made
(every ``*_proj`` linear: float8_e4m3fn + ``weight_scale_inv`` per block; embeddings, norms, the
router and the LM head stay float). Blocks are 16x16, matched to the tiny widths, and several
widths are not multiples of 16 (MLA's kv_lora_rank 24, rope/nope splits) so partial edge blocks
are exercised. The reference is HF on the dequantised weights (HF's own dequantiser,
``transformers.integrations.finegrained_fp8``). Tolerance: the float32 parity bound 1e-4, because
both sides compute in float32 on bit-identical weights (the product of an e4m3 value and a
float32 scale is one correctly rounded float32 multiply on either side), so only summation order
differs, as in the unquantised parity tests.

The FP8 fused-MoE kernel is tested in tests/test_fp8_kernel.py (no transformers there, so it
runs on the device machine).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from coordinator.model.engine import Engine
from expertmesh import quant
from expertmesh.checkpoint import CheckpointError, CheckpointReader
from tests.hf_models import make_checkpoint
from tests.test_parity import rel_err
from tests.test_rope_scaling import check_parity, make_scaled

BLOCK = (16, 16)


def hf_dequantize(w: torch.Tensor, s: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """HF transformers' FP8 dequantiser (the reference for the scale layout and edge blocks)."""
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    return _dequantize_fp8_weight(w, s, list(block), torch.float32)


def to_fp8(src: Path, fp8_dir: Path, ref_dir: Path, block=BLOCK) -> None:
    """src (an HF checkpoint) -> fp8_dir (FP8 block checkpoint) and ref_dir (its dequantised
    weights in float32, for HF to load as the reference)."""
    for d in (fp8_dir, ref_dir):
        shutil.copytree(src, d)
    tensors = load_file(src / "model.safetensors")
    q_out, ref_out = {}, {}
    for name, t in tensors.items():
        if name.endswith("_proj.weight") and t.dim() == 2:
            w, s = quant.quantize(t, block)
            q_out[name], q_out[name + "_scale_inv"] = w, s
            ref_out[name] = hf_dequantize(w, s, block)
        else:
            q_out[name] = ref_out[name] = t
    save_file(q_out, fp8_dir / "model.safetensors", metadata={"format": "pt"})
    save_file(ref_out, ref_dir / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((fp8_dir / "config.json").read_text())
    raw["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
    }
    (fp8_dir / "config.json").write_text(json.dumps(raw))
    ref = json.loads((ref_dir / "config.json").read_text())
    if ref["model_type"] == "kimi_k2":  # HF has no kimi_k2: its DeepSeek-V3 is the reference
        ref["model_type"] = "deepseek_v3"
    (ref_dir / "config.json").write_text(json.dumps(ref))


def hf_reference(ref_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()


# ---------------------------------------------------------------- dequantisation


@pytest.mark.parametrize(
    "shape, block", [((64, 48), (16, 16)), ((70, 45), (16, 32)), ((3, 130, 24), (128, 128))]
)
def test_dequantize_matches_hf_including_edge_blocks(shape, block):
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(len(shape))) * 3
    q, s = quant.quantize(w, block)
    want = quant.FP8BlockQuant(block).scale_shape(*shape[-2:])
    assert q.dtype == torch.float8_e4m3fn and s.shape[-2:] == want
    got = quant.dequantize(q, s, block)
    assert torch.equal(got, hf_dequantize(q, s, block))
    # the quantiser keeps e4m3's precision: 3 mantissa bits (<= 2^-4 relative) for normal
    # values, half the subnormal spacing (2^-10 of the block scale) below 2^-6 of it
    scale = s.repeat_interleave(block[0], -2).repeat_interleave(block[1], -1)[..., : shape[-2], : shape[-1]]
    assert ((got - w).abs() <= torch.maximum(w.abs() * 2**-4, scale * 2**-10) * (1 + 1e-6)).all()


def test_scale_shape_is_checked():
    q, s = quant.quantize(torch.randn(32, 32), (16, 16))
    with pytest.raises(quant.QuantizationError, match="does not tile"):
        quant.dequantize(q, s[:1], (16, 16))


# ---------------------------------------------------------------- checkpoints


def test_qwen3_fp8_checkpoint_in_process(tmp_path):
    """Qwen3-30B-A3B-FP8 style: in-process engine and the expert reader (what the CPU server
    reads) both see the dequantised weights."""
    hf_dir, fp8_dir, ref_dir = tmp_path / "hf", tmp_path / "fp8", tmp_path / "ref"
    make_checkpoint("qwen3_moe", hf_dir)
    to_fp8(hf_dir, fp8_dir, ref_dir)
    hf = hf_reference(ref_dir)
    reader = CheckpointReader(fp8_dir)
    assert reader.config.quant == quant.FP8BlockQuant(BLOCK) and reader.fp8_experts()
    name = "model.layers.0.mlp.experts.3.down_proj.weight"
    assert reader.stored_dtype(name) == torch.float8_e4m3fn
    w = reader.expert_weights(0, 3)
    ref = CheckpointReader(ref_dir).expert_weights(0, 3)
    assert w.w13.dtype == torch.float32 and torch.equal(w.w13, ref.w13) and torch.equal(w.w2, ref.w2)
    raw = reader.expert_weights(0, 3, keep_fp8=True)
    assert raw.w13.dtype == torch.float8_e4m3fn and raw.w13_scale is not None and raw.w2_scale is not None
    assert torch.equal(quant.dequantize(raw.w13, raw.w13_scale, BLOCK), ref.w13)
    assert not any(n.endswith("_scale_inv") for n in reader.names())
    eng = Engine.from_checkpoint(str(fp8_dir), dtype=torch.float32, page_size=8)
    ids = torch.randint(0, 96, (20,), generator=torch.Generator().manual_seed(2))
    got = eng.step([(eng.new_seq(), ids.tolist())], all_logits=True)[0]
    with torch.no_grad():
        assert rel_err(got, hf(ids[None]).logits[0]) < 1e-4


def test_partial_blocks_and_keep_fp8_refusal(tmp_path):
    """kv_b_proj [112, 24] has partial 16x16 blocks; experts with I % block != 0 cannot be kept
    in FP8 (gate and up would share a scale block) and are dequantised instead."""
    hf_dir, fp8_dir, ref_dir = tmp_path / "hf", tmp_path / "fp8", tmp_path / "ref"
    make_checkpoint("deepseek_v2", hf_dir)
    to_fp8(hf_dir, fp8_dir, ref_dir, block=(24, 16))  # moe_intermediate_size 32 % 24 != 0
    reader = CheckpointReader(fp8_dir)
    kvb = "model.layers.0.self_attn.kv_b_proj.weight"
    assert torch.equal(reader.get(kvb), CheckpointReader(ref_dir).get(kvb))
    assert not reader.fp8_experts()
    with pytest.raises(CheckpointError, match="not stored as block FP8"):
        reader.expert_weights(1, 0, keep_fp8=True)
    assert reader.expert_weights(1, 0).w13.dtype == torch.float32


def test_kimi_k2_fp8_yarn_in_process(tmp_path):
    hf_dir, fp8_dir, ref_dir = tmp_path / "hf", tmp_path / "fp8", tmp_path / "ref"
    make_scaled("kimi_k2", hf_dir)
    to_fp8(hf_dir, fp8_dir, ref_dir)
    eng = Engine.from_checkpoint(str(fp8_dir), dtype=torch.float32, page_size=8)
    check_parity(eng, hf_reference(ref_dir))


@pytest.mark.slow
def test_kimi_k2_fp8_yarn_over_cluster(tmp_path):
    """Coordinator + GPU expert server (on the CPU) + CPU expert server, experts split between
    them: a Kimi-K2-shaped FP8 checkpoint with YaRN, past original_max_position_embeddings."""
    from tests.cluster_utils import start_server
    from tests.test_cluster import engine_for, placements

    hf_dir, fp8_dir, ref_dir = tmp_path / "hf", tmp_path / "fp8", tmp_path / "ref"
    make_scaled("kimi_k2", hf_dir)
    to_fp8(hf_dir, fp8_dir, ref_dir)
    hf = hf_reference(ref_dir)
    gpu, cpu = start_server("gpu", fp8_dir), start_server("cpu", fp8_dir)
    try:
        ne = CheckpointReader(fp8_dir).config.num_experts
        eng, d = engine_for(fp8_dir, placements(gpu, cpu, fp8_dir, ne)["split"])
        try:
            check_parity(eng, hf)
            infos = d.server_infos()
            assert {i["kind"] for i in infos} == {"gpu", "cpu"}
            # on the CPU both servers hold the experts dequantised (Describe.weight_dtype): the
            # gpu-server's torch backend in the compute dtype, the cpu-server in its packing dtype
            dtypes = {i["kind"]: i["weight_dtype"] for i in infos}
            assert dtypes["gpu"] == "float32" and dtypes["cpu"] in ("float32", "bfloat16", "int8"), dtypes
        finally:
            d.close()
    finally:
        gpu.stop()
        cpu.stop()


def test_deepseek_v3_fp8_mtp_layer_skipped_with_a_note(tmp_path, caplog):
    """DeepSeek-V3's FP8 checkpoints carry an FP8 multi-token-prediction layer after the last
    decoder layer (model.layers.{n}); it is skipped with a log line, not an error."""
    import logging

    hf_dir, fp8_dir, ref_dir = tmp_path / "hf", tmp_path / "fp8", tmp_path / "ref"
    make_checkpoint("deepseek_v3", hf_dir)
    to_fp8(hf_dir, fp8_dir, ref_dir)
    raw = json.loads((fp8_dir / "config.json").read_text())
    n = raw["num_hidden_layers"]
    raw["num_nextn_predict_layers"] = 1
    (fp8_dir / "config.json").write_text(json.dumps(raw))
    tensors = load_file(fp8_dir / "model.safetensors")
    w, s = quant.quantize(torch.randn(64, 128), BLOCK)
    tensors[f"model.layers.{n}.eh_proj.weight"], tensors[f"model.layers.{n}.eh_proj.weight_scale_inv"] = w, s
    tensors[f"model.layers.{n}.enorm.weight"] = torch.ones(64)
    save_file(tensors, fp8_dir / "model.safetensors", metadata={"format": "pt"})
    caplog.set_level(logging.INFO, logger="coordinator.model.loader")
    eng = Engine.from_checkpoint(str(fp8_dir), dtype=torch.float32, page_size=8)
    assert any(
        "multi-token-prediction" in r.getMessage() and "2 tensors" in r.getMessage() for r in caplog.records
    )
    ids = list(range(3, 20))
    got = eng.step([(eng.new_seq(), ids)])[0]
    with torch.no_grad():
        assert rel_err(got, hf_reference(ref_dir)(torch.tensor([ids])).logits[0, -1]) < 1e-4
