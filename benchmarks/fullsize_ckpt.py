"""Full-size random checkpoints from published configs, in HF's per-expert tensor names
(benchmarks/bench_fullsize.py).

The configs are the published config.json values of Qwen/Qwen3-30B-A3B and
deepseek-ai/DeepSeek-V2-Lite (fields the loader and HF transformers read). Weights are bf16
tiled from a few random blocks per fan-in (scaled 1/sqrt(fan_in) so activations stay O(1));
the safetensors files are written directly (header + raw bytes): no tensor is materialised per
name, so 61 GB is written at the disk's speed. A directory already holding the same config is
reused.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

# published config.json of Qwen/Qwen3-30B-A3B
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
    "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [],
    "model_type": "qwen3_moe", "moe_intermediate_size": 768, "norm_topk_prob": True,
    "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
    "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936,
}  # fmt: skip

# published config.json of deepseek-ai/DeepSeek-V2-Lite
DEEPSEEK_V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001, "bos_token_id": 100000, "eos_token_id": 100001, "first_k_dense_replace": 1,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 10944,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v2",
    "moe_intermediate_size": 1408, "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64,
    "n_shared_experts": 2, "norm_topk_prob": False, "num_attention_heads": 16, "num_experts_per_tok": 6,
    "num_hidden_layers": 27, "num_key_value_heads": 16, "pretraining_tp": 1, "q_lora_rank": None,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 1.0, "scoring_func": "softmax", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 1, "topk_method": "greedy", "torch_dtype": "bfloat16",
    "use_cache": True, "v_head_dim": 128, "vocab_size": 102400,
}  # fmt: skip

CONFIGS = {"qwen3-30b-a3b": QWEN3_30B_A3B, "deepseek-v2-lite": DEEPSEEK_V2_LITE}
_EXPERTS = {"qwen3-30b-a3b": "num_experts", "deepseek-v2-lite": "n_routed_experts"}
_POOL = 1 << 24  # samples per random block (32 MiB of bf16)


def tiny_overrides(model: str) -> dict:
    """Small attention, vocab and dense widths (with --layers/--experts/--hidden: a CPU-sized run)."""
    ids = dict(bos_token_id=1, eos_token_id=2)  # inside the small vocabulary
    if model == "qwen3-30b-a3b":
        return dict(**ids, num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=1024,
                    intermediate_size=512, moe_intermediate_size=128, num_experts_per_tok=2)  # fmt: skip
    return dict(**ids, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=64, qk_nope_head_dim=32,
                qk_rope_head_dim=16, v_head_dim=32, vocab_size=1024, intermediate_size=512,
                moe_intermediate_size=128, num_experts_per_tok=2)  # fmt: skip


def make_config(model: str, over: dict) -> dict:
    cfg = dict(CONFIGS[model])
    for k, v in over.items():
        if k == "experts":
            cfg[_EXPERTS[model]] = v
        elif k == "top_k":
            cfg["num_experts_per_tok"] = v
        else:
            cfg[k] = v
    if model == "deepseek-v2-lite":
        cfg["rope_scaling"] = dict(cfg["rope_scaling"])
    return cfg


def tensor_shapes(cfg: dict) -> dict[int, list[tuple[str, tuple[int, ...], int]]]:
    """Per shard (-1: the layer-less tensors; else the layer): (name, shape, fan_in; 0 = ones)."""
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    shards: dict[int, list[tuple[str, tuple[int, ...], int]]] = {
        -1: [
            ("model.embed_tokens.weight", (v, h), 1),
            ("model.norm.weight", (h,), 0),
            ("lm_head.weight", (v, h), h),
        ]
    }
    ds = cfg["model_type"] == "deepseek_v2"
    e = cfg["n_routed_experts"] if ds else cfg["num_experts"]
    i = cfg["moe_intermediate_size"]
    nh = cfg["num_attention_heads"]
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        t = [(p + "input_layernorm.weight", (h,), 0), (p + "post_attention_layernorm.weight", (h,), 0)]
        if ds:
            nope, rope, vd, r = (
                cfg["qk_nope_head_dim"],
                cfg["qk_rope_head_dim"],
                cfg["v_head_dim"],
                cfg["kv_lora_rank"],
            )
            t += [
                (p + "self_attn.q_proj.weight", (nh * (nope + rope), h), h),
                (p + "self_attn.kv_a_proj_with_mqa.weight", (r + rope, h), h),
                (p + "self_attn.kv_a_layernorm.weight", (r,), 0),
                (p + "self_attn.kv_b_proj.weight", (nh * (nope + vd), r), r),
                (p + "self_attn.o_proj.weight", (h, nh * vd), nh * vd),
            ]
            moe = layer >= cfg["first_k_dense_replace"]
        else:
            hd, kv = cfg["head_dim"], cfg["num_key_value_heads"]
            t += [
                (p + "self_attn.q_proj.weight", (nh * hd, h), h),
                (p + "self_attn.k_proj.weight", (kv * hd, h), h),
                (p + "self_attn.v_proj.weight", (kv * hd, h), h),
                (p + "self_attn.o_proj.weight", (h, nh * hd), nh * hd),
                (p + "self_attn.q_norm.weight", (hd,), 0),
                (p + "self_attn.k_norm.weight", (hd,), 0),
            ]
            moe = layer not in cfg["mlp_only_layers"]
        if not moe:
            f = cfg["intermediate_size"]
            t += [(p + "mlp.gate_proj.weight", (f, h), h), (p + "mlp.up_proj.weight", (f, h), h),
                  (p + "mlp.down_proj.weight", (h, f), f)]  # fmt: skip
        else:
            t.append((p + "mlp.gate.weight", (e, h), h))
            for x in range(e):
                q = f"{p}mlp.experts.{x}."
                t += [(q + "gate_proj.weight", (i, h), h), (q + "up_proj.weight", (i, h), h),
                      (q + "down_proj.weight", (h, i), i)]  # fmt: skip
            if ds and cfg["n_shared_experts"]:
                s = i * cfg["n_shared_experts"]
                t += [(p + "mlp.shared_experts.gate_proj.weight", (s, h), h),
                      (p + "mlp.shared_experts.up_proj.weight", (s, h), h),
                      (p + "mlp.shared_experts.down_proj.weight", (h, s), s)]  # fmt: skip
        shards[layer] = t
    return shards


class _Blocks:
    """Random bf16 bytes per fan-in, generated once (on the GPU when there is one)."""

    def __init__(self, device: str) -> None:
        dev = device if device.startswith("cuda") and torch.cuda.is_available() else "cpu"
        g = torch.Generator(device=dev).manual_seed(0)
        self.base = torch.randn(_POOL, generator=g, device=dev)
        self.cache: dict[int, bytes] = {}
        self.ones: dict[int, bytes] = {}
        self.turn = 0

    def data(self, n: int, fan_in: int) -> list[memoryview]:
        """``n`` elements' bytes as views of the block (repeated as needed)."""
        if fan_in == 0:
            if n not in self.ones:
                self.ones[n] = torch.ones(n, dtype=torch.bfloat16).view(torch.int16).numpy().tobytes()
            return [memoryview(self.ones[n])]
        if fan_in not in self.cache:
            self.cache[fan_in] = (
                (self.base * fan_in**-0.5).bfloat16().view(torch.int16).cpu().numpy().tobytes()
            )
        block = memoryview(self.cache[fan_in])
        # NOTE: a different start each tensor, so consecutive experts differ
        self.turn = (self.turn + 7919) % (_POOL // 2)
        start, left, out = self.turn, n, []
        while left:
            k = min(left, _POOL - start)
            out.append(block[2 * start : 2 * (start + k)])
            left -= k
            start = 0
        return out


def _write_shard(
    path: Path, tensors: list[tuple[str, tuple[int, ...], int]], blocks: _Blocks
) -> dict[str, str]:
    header: dict = {"__metadata__": {"format": "pt"}}
    off = 0
    for name, shape, _ in tensors:
        n = 2 * int(torch.Size(shape).numel())
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for _, shape, fan_in in tensors:
            for chunk in blocks.data(int(torch.Size(shape).numel()), fan_in):
                f.write(chunk)
    return {name: path.name for name, _, _ in tensors}


def write_checkpoint(model: str, path: Path, over: dict, device: str = "cpu") -> tuple[dict, bool]:
    """Writes (or reuses) the checkpoint; returns (a summary of its config, whether it was written)."""
    cfg = make_config(model, over)
    shards = tensor_shapes(cfg)
    nbytes = sum(2 * int(torch.Size(s).numel()) for t in shards.values() for _, s, _ in t)
    summary = {
        "model": model,
        "layers": cfg["num_hidden_layers"],
        "experts": cfg[_EXPERTS[model]],
        "top_k": cfg["num_experts_per_tok"],
        "hidden": cfg["hidden_size"],
        "moe_intermediate": cfg["moe_intermediate_size"],
        "vocab": cfg["vocab_size"],
        "bytes": nbytes,
    }
    done = path / "model.safetensors.index.json"
    if done.exists() and json.loads((path / "config.json").read_text()) == cfg:
        return summary, False
    path.mkdir(parents=True, exist_ok=True)
    done.unlink(missing_ok=True)  # NOTE: written last: a half-written directory is never reused
    blocks = _Blocks(device)
    weight_map: dict[str, str] = {}
    for key, tensors in shards.items():
        name = "common.safetensors" if key < 0 else f"layer-{key:03d}.safetensors"
        weight_map.update(_write_shard(path / name, tensors, blocks))
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    done.write_text(json.dumps({"metadata": {"total_size": nbytes}, "weight_map": weight_map}))
    return summary, True
