"""No silent wrong weights: a quantisation this code does not implement is refused, with its
``quant_method`` named, by the config parser for every model_type, by CheckpointReader itself,
and by every process that reads weights (coordinator, gpu-server, cpu-server); a reader never
returns a tensor that is not a float (raw float8 without its scale, packed integers)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from expertmesh.checkpoint import CheckpointError, CheckpointReader
from expertmesh.config import ConfigError, ModelConfig
from tests.hf_models import BASE, CONFIGS, make_checkpoint

# quantization_config blocks as these libraries write them (fields abridged)
UNSUPPORTED = {
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True},
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm", "zero_point": True},
    "bitsandbytes": {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"},
    "compressed-tensors": {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {},
    },
    "mxfp4": {"quant_method": "mxfp4", "modules_to_not_convert": ["router"]},
    "fbgemm_fp8": {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0},
    "no_method": {"bits": 8},
}
# FP8 variants that are not the block-scaled dynamic e4m3 layout
UNSUPPORTED_FP8 = {
    "per_tensor": ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "weight_block_size"),
    "static_act": (
        {"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]},
        "activation_scheme='static'",
    ),
    "e5m2": ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "fmt='e5m2'"),
}
MODEL_TYPES = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v2", "deepseek_v3", "kimi_k2"]


def _raw(model_type: str) -> dict:
    base = "deepseek_v3" if model_type == "kimi_k2" else model_type
    return {**BASE, **CONFIGS[base], "model_type": model_type}


@pytest.mark.parametrize("method", list(UNSUPPORTED))
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_config_refuses_unimplemented_quantisation(model_type, method):
    raw = {**_raw(model_type), "quantization_config": UNSUPPORTED[method]}
    qm = UNSUPPORTED[method].get("quant_method")
    with pytest.raises(ConfigError, match=f"quant_method={qm!r}".replace("(", r"\(")):
        ModelConfig.from_dict(raw)


@pytest.mark.parametrize("variant", list(UNSUPPORTED_FP8))
def test_config_refuses_other_fp8_layouts(variant):
    qc, words = UNSUPPORTED_FP8[variant]
    with pytest.raises(ConfigError, match=words.replace("[", r"\[")):
        ModelConfig.from_dict({**_raw("qwen3_moe"), "quantization_config": qc})


def test_fp8_block_config_is_accepted_for_every_model_type():
    qc = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    for mt in MODEL_TYPES:
        cfg = ModelConfig.from_dict({**_raw(mt), "quantization_config": qc})
        assert cfg.quant is not None and cfg.quant.block == (128, 128), mt


def _gptq_checkpoint(path: Path) -> None:
    make_checkpoint("qwen3_moe", path)
    cfg_path = path / "config.json"
    raw = json.loads(cfg_path.read_text())
    raw["quantization_config"] = UNSUPPORTED["gptq"]
    cfg_path.write_text(json.dumps(raw))


def test_reader_refuses_even_with_a_config_given(tmp_path):
    """A reader opened with a config built elsewhere (no quant) still reads config.json's."""
    make_checkpoint("qwen3_moe", tmp_path)
    plain = ModelConfig.from_dir(tmp_path)
    _gptq_checkpoint(tmp_path)
    with pytest.raises(ConfigError, match="quant_method='gptq'"):
        CheckpointReader(tmp_path, plain)


def _rewrite(path: Path, edit) -> None:
    file = path / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_reader_never_returns_raw_float8(tmp_path):
    """The Qwen3-30B-A3B-FP8 failure: float8 expert weights with no scale applied used to reach
    an expert server as if they were weights."""
    make_checkpoint("qwen3_moe", tmp_path)
    name = "model.layers.0.mlp.experts.1.gate_proj.weight"
    _rewrite(tmp_path, lambda t: t.__setitem__(name, t[name].to(torch.float8_e4m3fn)))
    reader = CheckpointReader(tmp_path)  # no quantization_config at all
    with pytest.raises(CheckpointError, match="float8 with no block scale"):
        reader.expert_weights(0, 1)
    assert reader.expert_weights(0, 0).w13.dtype == torch.float32  # the others are fine
    # with an FP8 config but the scale tensor missing: still an error, naming the scale
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [16, 16]}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="weight_scale_inv' is missing"):
        CheckpointReader(tmp_path).expert_weights(0, 1)


def test_reader_refuses_packed_integer_weights(tmp_path):
    make_checkpoint("qwen3_moe", tmp_path)
    name = "model.layers.0.self_attn.o_proj.weight"
    _rewrite(tmp_path, lambda t: t.__setitem__(name, torch.zeros(8, 8, dtype=torch.int32)))
    with pytest.raises(CheckpointError, match="stored as torch.int32"):
        CheckpointReader(tmp_path).get(name)


@pytest.mark.parametrize(
    "argv",
    [
        ["coordinator", "--port", "0"],
        ["gpu-server", "--port", "0", "--device", "cpu"],
        ["cpu-server", "--port", "0"],
    ],
    ids=lambda a: a[0],
)
def test_every_entry_point_refuses_gptq(tmp_path, argv, capsys):
    """coordinator, gpu-server and cpu-server, through the CLI (in process, so it costs no
    interpreter start): an error naming quant_method, never a running server."""
    from expertmesh.cli import main

    _gptq_checkpoint(tmp_path)
    try:
        rc = main([argv[0], "--model", str(tmp_path), *argv[1:]])
    except ConfigError as e:  # the expert servers let it propagate out of serve()
        rc, out = 1, str(e)
    else:
        out = capsys.readouterr().err
    assert rc != 0 and "quant_method='gptq'" in out, out
