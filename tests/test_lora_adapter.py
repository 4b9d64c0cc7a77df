"""Adapter validation: every bad adapter is refused with a message naming what is wrong, and a
refused adapter leaves nothing behind. Also the fused-tensor orientation of PEFT's
``target_parameters`` form, checked against PEFT's own delta weights."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from coordinator.lora import AdapterError, enable_lora, load_adapter
from coordinator.model.engine import Engine
from expertmesh.config import ModelConfig
from tests import lora_utils

P = "base_model.model.model.layers"


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """(model dir, fused adapter dir, per-expert adapter dir, PEFT's layer-0 expert deltas)."""
    root = tmp_path_factory.mktemp("lora_adapter")
    hf = lora_utils.make_model("qwen2_moe", root / "model")
    pm = lora_utils.wrap(hf)
    fused = lora_utils.save(pm, root / "fused")
    outer = pm.base_model.model.model.layers[0].mlp.experts  # ParamWrapper nesting another
    with torch.no_grad():
        deltas = {w.parameter_name: w.get_delta_weight("default") for w in (outer, outer.base_layer)}
    lora_utils.split_gate_up(pm, 8, 24)
    split = lora_utils.save(pm, root / "split")
    per_expert = lora_utils.to_per_expert(split, root / "per_expert", 8, 64, 24)
    return root / "model", fused, per_expert, deltas


def mutate(
    src: Path,
    dst: Path,
    tensors: Callable[[dict], None] | None = None,
    config: Callable[[dict], None] | None = None,
) -> Path:
    shutil.copytree(src, dst)
    if tensors is not None:
        t = load_file(dst / "adapter_model.safetensors")
        tensors(t)
        save_file(t, dst / "adapter_model.safetensors")
    if config is not None:
        c = json.loads((dst / "adapter_config.json").read_text())
        config(c)
        (dst / "adapter_config.json").write_text(json.dumps(c))
    return dst


def _rename(old: str, new: str):
    def f(t: dict) -> None:
        for k in [k for k in t if old in k]:
            t[k.replace(old, new)] = t.pop(k)

    return f


def _set(key: str, value):
    def f(d: dict) -> None:
        d[key] = value

    return f


def _add(key: str, shape: tuple[int, ...]):
    def f(t: dict) -> None:
        t[key] = torch.randn(*shape)

    return f


def _reshape_b(module: str):
    def f(t: dict) -> None:
        k = f"{P}.{module}.lora_B.weight"
        t[k] = t[k][:-1]

    return f


def _poison(module: str, value: float):
    def f(t: dict) -> None:
        k = f"{P}.{module}.lora_B.weight"
        t[k] = t[k].clone()
        t[k][0, 0] = value

    return f


CASES = {
    # (which adapter, tensors mutation, config mutation, words the message must contain)
    "wrong_rank": ("fused", None, _set("r", 3), ["rank 4", "r=3"]),
    "wrong_shape": (
        "fused",
        _reshape_b("0.self_attn.q_proj"),
        None,
        ["self_attn.q_proj", "[63, 4]", "[64, r]"],
    ),
    "expert_shape": (
        "per_expert",
        _reshape_b("2.mlp.experts.5.down_proj"),
        None,
        ["layer 2 expert 5", "[63, 4]"],
    ),
    "layer_out_of_range": (
        "per_expert",
        _rename(".layers.2.mlp.experts.", ".layers.7.mlp.experts."),
        None,
        ["layer 7"],
    ),
    "expert_out_of_range": (
        "per_expert",
        _rename(".experts.3.", ".experts.8."),
        None,
        ["expert 8", "out of range"],
    ),
    "fused_shape": ("fused", _reshape_b("1.mlp.experts.base_layer"), None, ["layer 1", "fit neither"]),
    "embeddings": (
        "fused",
        _add("base_model.model.model.embed_tokens.lora_A.weight", (4, 96)),
        None,
        ["embed_tokens"],
    ),
    "lm_head": ("fused", _add("base_model.model.lm_head.lora_A.weight", (4, 64)), None, ["lm_head"]),
    "dora_tensor": (
        "fused",
        _add(f"{P}.0.self_attn.q_proj.lora_magnitude_vector", (64,)),
        None,
        ["lora_magnitude_vector", "DoRA"],
    ),
    "dora_config": ("fused", None, _set("use_dora", True), ["use_dora", "DoRA"]),
    "modules_to_save": ("fused", None, _set("modules_to_save", ["lm_head"]), ["modules_to_save"]),
    "nan": ("fused", _poison("0.self_attn.q_proj", float("nan")), None, ["0.self_attn.q_proj.lora_B", "NaN"]),
    "inf_expert": (
        "per_expert",
        _poison("2.mlp.experts.5.down_proj", float("-inf")),
        None,
        ["2.mlp.experts.5.down_proj.lora_B", "infinite"],
    ),
    "router_gate": ("fused", _add(f"{P}.0.mlp.gate.lora_A.weight", (4, 64)), None, ["mlp.gate"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_adapter_is_refused(made, case, tmp_path):
    model_dir, fused, per_expert, _ = made
    which, tensors, config, words = CASES[case]
    path = mutate(fused if which == "fused" else per_expert, tmp_path / case, tensors, config)
    eng = Engine.from_checkpoint(str(model_dir), page_size=4)
    mgr = enable_lora(eng, max_loras=2)
    with pytest.raises(AdapterError) as err:
        mgr.load("bad", str(path))
    for w in words:
        assert w in str(err.value), f"{case}: {w!r} not in {err.value}"
    # nothing half-loaded: no adapter, no slot, no projection LoRA, no expert buffers
    assert not mgr.adapters and not mgr.slot_of and not any(mgr.proj.values()) and not mgr.experts
    with pytest.raises(KeyError):
        eng.step([(eng.new_seq(), [1, 2, 3])], adapters=["bad"])


def test_unpaired_and_missing_files(made, tmp_path):
    model_dir, fused, _, _ = made
    cfg = ModelConfig.from_dir(model_dir)
    path = mutate(fused, tmp_path / "unpaired", lambda t: t.pop(f"{P}.0.self_attn.o_proj.lora_B.weight"))
    with pytest.raises(AdapterError, match="o_proj.*not its pair"):
        load_adapter("x", path, cfg)
    (tmp_path / "empty").mkdir()
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        load_adapter("x", tmp_path / "empty", cfg)
    with pytest.raises(AdapterError, match="not a directory"):
        load_adapter("x", tmp_path / "nope", cfg)


def test_fused_orientation_matches_peft_delta(made):
    """Per expert, B13 A13 and B2 A2 as loaded equal PEFT's own delta weights of the fused
    parameters (ParamWrapper.get_delta_weight), with 2I != H so a transposition cannot pass."""
    model_dir, fused, _, deltas = made
    lo = load_adapter("x", fused, ModelConfig.from_dir(model_dir)).experts[0]
    assert deltas["gate_up_proj"].shape == (8, 48, 64) and deltas["down_proj"].shape == (8, 64, 24)
    assert lo.a13.shape == (8, 8, 64) and lo.b13.shape == (8, 48, 8)  # rank 8 from the pattern
    assert torch.allclose(lo.b13 @ lo.a13, deltas["gate_up_proj"], atol=1e-5)
    assert torch.allclose(lo.b2 @ lo.a2, deltas["down_proj"], atol=1e-5)
