"""Tiny random PEFT LoRA adapters for the LoRA tests (PEFT is the reference, never runtime).

``make_peft_adapter`` wraps a tiny HF model (tests/hf_models.py, with non-square expert widths:
2I != H) in a PEFT LoRA with random non-zero B (``init_lora_weights=False``) on the attention
projections, shared experts, dense MLPs and the fused 3-D expert tensors
(``target_parameters``), with per-module rank/alpha patterns, and saves it. ``to_per_expert``
rewrites a saved fused-form adapter as per-expert linears (``experts.{e}.gate_proj`` etc., or
Mixtral's ``w1/w3/w2``) that compute the same thing, with SEPARATE A matrices for gate and up
(the PEFT model's gate_up B is made block-diagonal first: ``split_gate_up``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests import hf_models

R = 4  # default rank; experts' gate_up gets 2R so that gate and up can own R rows each
ALPHA = 8.0
EXPERT_WIDTH = {  # expert intermediate sizes with 2I != H (H = 64)
    "qwen3_moe": {"moe_intermediate_size": 24},
    "qwen2_moe": {"moe_intermediate_size": 24},
    "mixtral": {"intermediate_size": 24},
    "olmoe": {"intermediate_size": 24},
    "deepseek_v2": {"moe_intermediate_size": 24},
    "deepseek_v2_grouped": {"moe_intermediate_size": 24},
    "deepseek_v3": {"moe_intermediate_size": 24},
}
TARGET_MODULES = [
    "q_proj", "k_proj", "v_proj", "o_proj",  # GQA attention
    "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",  # MLA
    "gate_proj", "up_proj", "down_proj",  # dense MLPs and shared experts (experts are fused in HF)
]  # fmt: skip


def make_model(arch: str, out: Path, seed: int = 0):
    """A tiny HF model of ``arch`` with non-square expert widths, saved to ``out``."""
    saved = hf_models.CONFIGS[arch]
    hf_models.CONFIGS[arch] = {**saved, **EXPERT_WIDTH[arch]}
    try:
        return hf_models.make_checkpoint(arch, out, seed=seed)
    finally:
        hf_models.CONFIGS[arch] = saved


def peft_config(rslora: bool = False):
    from peft import LoraConfig

    patterns = {} if rslora else {"rank_pattern": {"o_proj": 6}, "alpha_pattern": {"down_proj": 5.0}}
    return LoraConfig(
        r=R,
        lora_alpha=ALPHA,
        target_modules=TARGET_MODULES,
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        init_lora_weights=False,
        use_rslora=rslora,
        **patterns,
    )


def wrap(hf, rslora: bool = False, seed: int = 1):
    """A PEFT model around ``hf`` with a random adapter (gate_up of rank 2R via the pattern)."""
    from peft import get_peft_model

    cfg = peft_config(rslora)
    cfg.rank_pattern = {**cfg.rank_pattern, "gate_up_proj": 2 * R}
    torch.manual_seed(seed)
    pm = get_peft_model(hf, cfg).eval()
    # PEFT's random init is small next to the x8-scaled base weights: scale B up so the adapter
    # visibly changes logits (a test that passes with the adapter ignored proves nothing)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.mul_(4.0)
    return pm


def split_gate_up(pm, num_experts: int, inter: int) -> None:
    """Zeroes the off-diagonal blocks of every fused gate_up B so that gate uses A rows 0..R-1
    only and up rows R..2R-1 only: gate and up then have separate A matrices."""
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if (
                "experts" in name
                and "lora_B" in name
                and p.shape[0] == 2 * inter
                and p.shape[1] == 2 * R * num_experts
            ):
                b = p.view(2 * inter, 2 * R, num_experts)  # rank-major columns
                b[:inter, R:, :] = 0
                b[inter:, :R, :] = 0


def save(pm, out: Path) -> Path:
    pm.save_pretrained(out)
    return out


def _scaling(cfg: dict, module: str, r: int) -> float:
    import math
    import re

    alpha = cfg["lora_alpha"]
    for key, val in (cfg.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            alpha = val
            break
    return alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r


def to_per_expert(
    src: Path, dst: Path, num_experts: int, hidden: int, inter: int, mixtral: bool = False
) -> Path:
    """Rewrites the fused expert tensors of adapter ``src`` as per-expert linears in ``dst``."""
    cfg = json.loads((src / "adapter_config.json").read_text())
    tensors = load_file(src / "adapter_model.safetensors")
    out: dict[str, torch.Tensor] = {}
    names = (
        {"gate": "w1", "up": "w3", "down": "w2"}
        if mixtral
        else {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
    )
    block = "block_sparse_moe" if mixtral else "mlp"
    for key, t in tensors.items():
        if ".mlp.experts." not in key or ".lora_B." in key:
            if ".mlp.experts." not in key:
                out[key] = t
            continue
        mod = key.rsplit(".lora_A.", 1)[0]
        a, b = t, tensors[f"{mod}.lora_B.weight"]
        layer = int(key.split(".layers.")[1].split(".")[0])
        prefix = f"base_model.model.model.layers.{layer}.{block}.experts"
        e_num = num_experts
        r = a.shape[0] // e_num
        a_e = a.reshape(e_num, r, a.shape[1])
        b_e = b.reshape(b.shape[0], r, e_num)
        is_down = a.shape[1] == inter and b.shape[0] == hidden
        pname = f"model.layers.{layer}.mlp.experts.{'down_proj' if is_down else 'gate_up_proj'}"
        s_fused = _scaling(cfg, pname, r)
        for e in range(e_num):
            be = b_e[:, :, e] * s_fused  # [out, r] true delta factor
            if is_down:
                parts = {"down": (a_e[e], be)}
            else:
                h = r // 2
                parts = {"gate": (a_e[e, :h], be[:inter, :h]), "up": (a_e[e, h:], be[inter:, h:])}
            for proj, (pa, pb) in parts.items():
                name = f"{prefix}.{e}.{names[proj]}"
                # the per-expert module's own scaling, as the loader will compute it
                s = _scaling(cfg, name.removeprefix("base_model.model."), pa.shape[0])
                out[f"{name}.lora_A.weight"] = pa.contiguous()
                out[f"{name}.lora_B.weight"] = (pb / s).contiguous()
    cfg["target_parameters"] = None
    cfg["rank_pattern"] = {k: v for k, v in (cfg.get("rank_pattern") or {}).items() if k != "gate_up_proj"}
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    save_file(out, dst / "adapter_model.safetensors")
    return dst
