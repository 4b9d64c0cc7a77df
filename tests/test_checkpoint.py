"""Checkpoint reader: shards, both expert layouts, lazy single-expert reads, clear errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from coordinator.model.engine import Engine
from coordinator.model.loader import load_model
from expertmesh.checkpoint import CheckpointError, CheckpointReader
from expertmesh.config import ConfigError, ModelConfig
from tests.hf_models import make_checkpoint


def hf_expert(hf, layer: int, e: int) -> tuple[torch.Tensor, torch.Tensor]:
    ex = hf.model.layers[layer].mlp.experts
    return ex.gate_up_proj[e].detach(), ex.down_proj[e].detach()


@pytest.mark.parametrize("original_format", [True, False], ids=["per_expert", "fused"])
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_sharded_checkpoint_reads_one_expert_lazily(arch, original_format, tmp_path):
    hf = make_checkpoint(arch, tmp_path, original_format=original_format, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    shards = {p.name for p in tmp_path.glob("*.safetensors")}
    assert len(shards) > 3
    reader = CheckpointReader(tmp_path)
    w = reader.expert_weights(2, 5)
    gate_up, down = hf_expert(hf, 2, 5)
    torch.testing.assert_close(w.w13, gate_up, rtol=0, atol=0)
    torch.testing.assert_close(w.w2, down, rtol=0, atol=0)
    # only the shards holding that expert's tensors were opened
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    mine = ("experts.5.", "experts.gate_up_proj", "experts.down_proj")
    holding = {
        f for n, f in weight_map.items() if n.startswith("model.layers.2.") and any(m in n for m in mine)
    }
    assert set(reader._handles) <= holding and len(reader._handles) < len(shards), reader._handles.keys()


def test_fused_layout_reads_a_slice_not_the_stack(tmp_path, monkeypatch):
    make_checkpoint("qwen3_moe", tmp_path, original_format=False)
    reader = CheckpointReader(tmp_path)
    read_whole = []
    monkeypatch.setattr(reader, "get", lambda name, shape=None: read_whole.append(name))
    reader.expert_weights(0, 3)
    assert read_whole == []


def test_coordinator_share_excludes_routed_experts(tmp_path):
    make_checkpoint("qwen2_moe", tmp_path)
    names = CheckpointReader(tmp_path).non_expert_tensors().keys()
    assert not [n for n in names if ".experts." in n]
    assert any("shared_expert." in n for n in names)


def test_sharded_model_loads_with_parity(tmp_path):
    hf = make_checkpoint("qwen3_moe", tmp_path, max_shard_size="40KB")
    eng = Engine.from_checkpoint(str(tmp_path))
    ids = list(range(3, 12))
    got = eng.step([(eng.new_seq(), ids)])[0]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-4


def _rewrite(path, mutate):
    f = path / "model.safetensors"
    tensors = load_file(str(f))
    mutate(tensors)
    save_file(tensors, str(f))


def test_missing_tensor_names_it_and_its_shape(tmp_path):
    make_checkpoint("qwen3_moe", tmp_path)
    _rewrite(tmp_path, lambda t: t.pop("model.layers.0.self_attn.k_proj.weight"))
    with pytest.raises(
        CheckpointError,
        match=r"missing tensors 'model.layers.0.self_attn.k_proj.weight' \(expected shape \[32, 64\]\)",
    ):
        load_model(CheckpointReader(tmp_path), torch.float32, "cpu")


def test_missing_expert_names_it_and_its_shape(tmp_path):
    make_checkpoint("qwen3_moe", tmp_path)
    _rewrite(tmp_path, lambda t: t.pop("model.layers.2.mlp.experts.4.up_proj.weight"))
    with pytest.raises(
        CheckpointError, match=r"model.layers.2.mlp.experts.4.up_proj.weight.*missing.*\[32, 64\]"
    ):
        CheckpointReader(tmp_path).expert_weights(2, 4)


def test_wrong_shape_names_tensor_and_both_shapes(tmp_path):
    make_checkpoint("qwen3_moe", tmp_path)

    def shrink(t):
        t["model.layers.0.mlp.experts.1.down_proj.weight"] = torch.zeros(64, 31)
        t["model.norm.weight"] = torch.ones(63)

    _rewrite(tmp_path, shrink)
    with pytest.raises(
        CheckpointError, match=r"experts.1.down_proj.weight.*shape \[64, 31\], expected \[64, 32\]"
    ):
        CheckpointReader(tmp_path).expert_weights(0, 1)
    with pytest.raises(CheckpointError, match=r"model.norm.weight.*shape \[63\], expected \[64\]"):
        load_model(CheckpointReader(tmp_path), torch.float32, "cpu")


def test_fused_wrong_shape(tmp_path):
    make_checkpoint("qwen3_moe", tmp_path, original_format=False)
    _rewrite(
        tmp_path, lambda t: t.__setitem__("model.layers.0.mlp.experts.down_proj", torch.zeros(8, 64, 16))
    )
    with pytest.raises(CheckpointError, match=r"experts.down_proj.*\[8, 64, 16\]"):
        CheckpointReader(tmp_path).expert_weights(0, 1)


def test_unexpected_tensor_is_an_error(tmp_path):
    make_checkpoint("qwen3_moe", tmp_path)
    _rewrite(tmp_path, lambda t: t.__setitem__("model.layers.0.self_attn.extra.weight", torch.zeros(2)))
    with pytest.raises(CheckpointError, match="extra.weight"):
        load_model(CheckpointReader(tmp_path), torch.float32, "cpu")


@pytest.mark.parametrize(
    "patch, words",
    [
        ({"model_type": "llama"}, "unsupported model_type 'llama'"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        # yarn and linear are implemented now (tests/test_rope_scaling.py); dynamic is not
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 4.0}}, "rope_type='dynamic'"),
        ({"use_sliding_window": True, "sliding_window": 128}, "sliding_window"),
        ({"num_experts_per_tok": None}, "'num_experts_per_tok' is required"),
    ],
)
def test_unsupported_config_is_named(tmp_path, patch, words):
    make_checkpoint("qwen3_moe", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(patch)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace("(", r"\(")):
        ModelConfig.from_dir(tmp_path)


def test_expert_index_errors(tmp_path):
    make_checkpoint("qwen3_moe", tmp_path)  # layer 1 is a dense (mlp_only) layer
    reader = CheckpointReader(tmp_path)
    with pytest.raises(CheckpointError, match="layer 1 is not an MoE layer"):
        reader.expert_weights(1, 0)
    with pytest.raises(CheckpointError, match="expert 8 out of range"):
        reader.expert_weights(0, 8)
