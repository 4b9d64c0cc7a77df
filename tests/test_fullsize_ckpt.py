"""benchmarks/fullsize_ckpt.py writes checkpoints HF transformers and our reader load whole:
every tensor of the published architecture present under HF's per-expert names, none extra,
every shape right (at a tiny size; the full size differs only in the numbers)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from fullsize_ckpt import CONFIGS, tiny_overrides, write_checkpoint  # noqa: E402

from expertmesh.checkpoint import CheckpointReader  # noqa: E402


@pytest.mark.parametrize("model", sorted(CONFIGS))
def test_tiny_checkpoint_loads_in_hf_without_missing_or_extra_tensors(model, tmp_path):
    from transformers import AutoModelForCausalLM

    over = {**tiny_overrides(model), "num_hidden_layers": 3, "experts": 8, "hidden_size": 64}
    summary, wrote = write_checkpoint(model, tmp_path, over)
    assert wrote and summary["experts"] == 8 and summary["layers"] == 3
    hf, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True, dtype=torch.bfloat16)
    assert {k: list(v) for k, v in info.items() if v} == {}
    # what HF built from the files is what they hold (sizes: the index's total)
    total = sum(p.numel() * p.element_size() for p in hf.state_dict().values())
    assert (
        total
        == summary["bytes"]
        == json.loads((tmp_path / "model.safetensors.index.json").read_text())["metadata"]["total_size"]
    )
    r = CheckpointReader(tmp_path)
    w = r.expert_weights(r.config.moe_layer_ids[-1], 7)
    assert tuple(w.w13.shape) == (2 * r.config.moe_intermediate_size, 64) and bool(w.w13.float().std() > 0)
    assert write_checkpoint(model, tmp_path, over)[1] is False  # the same config: reused
