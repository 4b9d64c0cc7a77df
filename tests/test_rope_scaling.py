"""Scaled rotary embeddings (YaRN, linear) against HF transformers: float32 logits and greedy
tokens of tiny models whose ``original_max_position_embeddings`` (32) is shorter than the
sequences run (up to 48 positions), so the scaled frequencies and DeepSeek's softmax-scale
correction all matter.

Kimi-K2 (``model_type: kimi_k2``) has no HF class: its checkpoint is written by HF's
DeepSeek-V3 with a Kimi-K2-shaped config, config.json then renamed to what Kimi publishes, and
HF's DeepSeek-V3 with the same weights is the reference.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from coordinator.model.engine import Engine
from coordinator.model.models import rope
from expertmesh.config import ConfigError, ModelConfig
from tests.hf_models import BASE, CONFIGS
from tests.test_parity import hf_greedy, rel_err

ORIG = 32  # original_max_position_embeddings: every prompt below runs past it
PROMPT, DECODE = 40, 8

# the rope fields each family publishes (factor, mscale ... as in their config.json), with the
# original length shrunk to ORIG
SCALED: dict[str, dict] = {
    # DeepSeek-V2-Lite: yarn factor 40, mscale = mscale_all_dim = 0.707, beta 32/1
    "deepseek_v2_yarn": dict(
        base="deepseek_v2",
        rope_scaling=dict(
            type="yarn",
            factor=40.0,
            original_max_position_embeddings=ORIG,
            beta_fast=32,
            beta_slow=1,
            mscale=0.707,
            mscale_all_dim=0.707,
        ),
    ),
    # DeepSeek-V3 shape with group-limited routing; mscale != mscale_all_dim so the cos/sin factor
    # is not 1 (V3 publishes 1.0/1.0: the Kimi case below covers equal values)
    "deepseek_v3_yarn": dict(
        base="deepseek_v3",
        rope_scaling=dict(
            type="yarn",
            factor=40.0,
            original_max_position_embeddings=ORIG,
            beta_fast=32,
            beta_slow=1,
            mscale=1.0,
            mscale_all_dim=0.8,
        ),
    ),
    # Kimi-K2-Instruct: yarn factor 32, beta_fast = beta_slow = 1 (a zero-width ramp), mscale 1/1,
    # one expert group, 1 shared expert, 1 dense layer, routed_scaling_factor 2.827
    "kimi_k2": dict(
        base="deepseek_v3",
        n_group=1,
        topk_group=1,
        num_experts_per_tok=4,
        routed_scaling_factor=2.827,
        rope_scaling=dict(
            type="yarn",
            factor=32.0,
            original_max_position_embeddings=ORIG,
            beta_fast=1.0,
            beta_slow=1.0,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
    ),
    # Qwen3-MoE as its model cards say to enable long context: yarn factor 4
    "qwen3_moe_yarn": dict(
        base="qwen3_moe",
        rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=ORIG),
    ),
    "qwen3_moe_linear": dict(base="qwen3_moe", rope_scaling=dict(rope_type="linear", factor=2.0)),
    "mixtral_linear": dict(base="mixtral", rope_scaling=dict(rope_type="linear", factor=4.0)),
}


def make_scaled(name: str, out: Path, seed: int = 0, original_format: bool = True):
    """Saves a random HF model of SCALED[name] to ``out``, config.json with the rope fields in
    the legacy ``rope_scaling`` form the published checkpoints use; returns the HF model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(SCALED[name])
    base = spec.pop("base")
    torch.manual_seed(seed)
    fields = {**BASE, **CONFIGS[base], **spec}
    cfg = AutoConfig.for_model(base, **fields)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # as tests/hf_models.py: weights far from ties
        for p in model.parameters():
            p.mul_(8.0 if p.dim() >= 2 else 1.0)
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.uniform_(0.8, 1.2)
        for bname, b in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):
                b.uniform_(-0.3, 0.3)
    model.save_pretrained(out, save_original_format=original_format)
    path = out / "config.json"
    raw = json.loads(path.read_text())
    params = raw.pop("rope_parameters", None) or {}
    raw["rope_theta"] = params.pop("rope_theta", raw.get("rope_theta", 10000.0))
    raw["rope_scaling"] = spec["rope_scaling"]
    if name == "kimi_k2":
        raw["model_type"] = "kimi_k2"
    path.write_text(json.dumps(raw))
    return model


def check_parity(eng: Engine, hf) -> None:
    """Prefill of PROMPT tokens then DECODE greedy steps, past ORIG: logits rel err < 1e-4 at
    every position and identical tokens."""
    prompt = torch.randint(0, 96, (PROMPT,), generator=torch.Generator().manual_seed(5))
    sid = eng.new_seq()
    full = eng.step([(sid, prompt.tolist())], all_logits=True)[0]
    with torch.no_grad():
        assert rel_err(full, hf(prompt[None]).logits[0]) < 1e-4
        ref_toks, ref_logits = hf_greedy(hf, prompt, DECODE)
    toks, logits = [int(full[-1].argmax())], [full[-1]]
    for _ in range(DECODE - 1):
        out = eng.step([(sid, [toks[-1]])])[0]
        logits.append(out)
        toks.append(int(out.argmax()))
    assert toks == ref_toks
    assert rel_err(torch.stack(logits), ref_logits) < 1e-4


@pytest.mark.parametrize("name", list(SCALED))
def test_scaled_rope_parity(name, tmp_path):
    hf = make_scaled(name, tmp_path)
    eng = Engine.from_checkpoint(str(tmp_path), dtype=torch.float32, page_size=8)
    check_parity(eng, hf)


def test_rope_quantities_equal_hf(tmp_path):
    """inv_freq and the cos/sin factor equal HF's ROPE_INIT_FUNCTIONS, and the MLA softmax scale
    equals HF's DeepSeek attention, for the published configs at their real widths."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    published = {
        # (base, fields): DeepSeek-V2-Lite, DeepSeek-V3, Kimi-K2, Qwen3-235B with yarn
        "v2_lite": ("deepseek_v2", dict(qk_rope_head_dim=64, max_position_embeddings=163840, rope_theta=10000,
                    rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096,
                                      beta_fast=32, beta_slow=1, mscale=0.707, mscale_all_dim=0.707))),
        "v3": ("deepseek_v3", dict(qk_rope_head_dim=64, max_position_embeddings=163840, rope_theta=10000,
               rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096,
                                 beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0))),
        "kimi": ("deepseek_v3", dict(qk_rope_head_dim=64, max_position_embeddings=131072, rope_theta=50000.0,
                 rope_scaling=dict(type="yarn", factor=32.0, original_max_position_embeddings=4096,
                                   beta_fast=1.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0))),
        "qwen3": ("qwen3_moe", dict(head_dim=128, max_position_embeddings=131072, rope_theta=1000000.0,
                  rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32768))),
    }  # fmt: skip
    for name, (base, fields) in published.items():
        hf_cfg = AutoConfig.for_model(base, **{**BASE, **CONFIGS[base], **fields})
        raw = {**BASE, **CONFIGS[base], **fields, "model_type": base}
        ours = ModelConfig.from_dict(raw)
        dim = ours.qk_rope_head_dim if ours.attention == "mla" else ours.head_dim
        ref_inv, ref_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, torch.device("cpu"))
        got = rope.inv_freq(dim, ours.rope_theta, ours.rope_scaling)
        assert torch.equal(got, ref_inv), name
        assert rope.attention_factor(ours.rope_scaling) == pytest.approx(ref_factor, rel=1e-12), name
        if ours.attention == "mla":
            hf_cfg.num_hidden_layers = 1
            attn = AutoModelForCausalLM.from_config(hf_cfg).model.layers[0].self_attn
            want = attn.scaling
            got_scale = ours.q_head_dim**-0.5 * rope.softmax_scale_factor(ours.rope_scaling)
            assert got_scale == pytest.approx(want, rel=1e-12), name
            if name != "v2_lite":  # V2-Lite's 0.707/0.707 cancel in cos/sin but not in the softmax
                assert want != pytest.approx(ours.q_head_dim**-0.5)
    # the DeepSeek-V3 correction at its published numbers: (0.1 ln 40 + 1)^2
    assert rope.softmax_scale_factor(ModelConfig.from_dict({**BASE, **CONFIGS["deepseek_v3"], "model_type": "deepseek_v3",
        "rope_scaling": published["v3"][1]["rope_scaling"]}).rope_scaling) == pytest.approx((0.1 * math.log(40) + 1) ** 2)  # fmt: skip


def test_kimi_k2_is_deepseek_v3(tmp_path):
    make_scaled("kimi_k2", tmp_path)
    cfg = ModelConfig.from_dir(tmp_path)
    assert cfg.model_type == "deepseek_v3" and cfg.extra["hf_model_type"] == "kimi_k2"
    assert cfg.topk_method == "noaux_tc" and cfg.routed_scaling_factor == pytest.approx(2.827)
    assert cfg.rope_scaling is not None and cfg.rope_scaling.factor == 32.0


@pytest.mark.parametrize(
    "scaling, words",
    [
        ({"rope_type": "dynamic", "factor": 2.0}, "rope_type='dynamic'"),
        ({"rope_type": "llama3", "factor": 8.0}, "rope_type='llama3'"),
        ({"rope_type": "longrope", "factor": 2.0}, "rope_type='longrope'"),
        ({"rope_type": "yarn"}, "needs a positive numeric factor"),
    ],
)
def test_unimplemented_rope_is_refused(scaling, words):
    raw = {**BASE, **CONFIGS["qwen3_moe"], "model_type": "qwen3_moe", "rope_scaling": scaling}
    with pytest.raises(ConfigError, match=words):
        ModelConfig.from_dict(raw)
