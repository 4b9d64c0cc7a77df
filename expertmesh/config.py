"""Model configuration parsed from a Hugging Face ``config.json``.

One frozen dataclass, :class:`ModelConfig`, describes every architecture expertmesh serves.
Each supported ``model_type`` has a parser that maps the HF fields onto it and rejects the
fields this code does not implement (a clear :class:`ConfigError` naming the field), so that a
checkpoint is never served with silently different maths.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from expertmesh.quant import FP8BlockQuant, QuantizationError, parse_quantization


class ConfigError(ValueError):
    """The checkpoint's config asks for something this code does not support."""


# rope types whose frequencies do not depend on the batch; see coordinator/model/models/rope.py
ROPE_TYPES = ("default", "linear", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    """A scaled rotary embedding (HF ``rope_scaling`` / ``rope_parameters``), fields as HF names them.

    ``mscale``/``mscale_all_dim``/``attention_factor`` are None where the config leaves them out
    (HF treats a missing and a zero mscale alike: both mean "derive from factor only")."""

    rope_type: str  # "linear" | "yarn"
    factor: float
    original_max_position_embeddings: int = 0  # yarn only
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        assert self.rope_type in ROPE_TYPES[1:], self.rope_type
        assert self.factor > 0, self.factor
        assert self.rope_type != "yarn" or self.original_max_position_embeddings > 0, self


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    # attention: "mha" (GQA/MHA with rotary) or "mla" (DeepSeek multi-head latent attention)
    attention: str = "mha"
    qkv_bias: bool = False
    o_bias: bool = False
    # "none" | "head" (RMSNorm per head, Qwen3) | "full" (RMSNorm over the projection, OLMoE)
    qk_norm: str = "none"
    clip_qkv: float | None = None
    # MLA (DeepSeek-V2/V3)
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    # dense MLP (non-MoE layers)
    intermediate_size: int = 0
    # MoE
    num_experts: int = 0
    top_k: int = 0
    moe_intermediate_size: int = 0
    moe_layers: tuple[bool, ...] = ()
    scoring: str = "softmax"  # "softmax" | "sigmoid"
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    topk_method: str = "greedy"  # "greedy" | "group_limited_greedy" | "noaux_tc"
    n_group: int = 1
    topk_group: int = 1
    correction_bias: bool = False
    shared_expert_intermediate_size: int = 0
    shared_expert_gate: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # None: plain rotary embeddings
    rope_scaling: RopeScaling | None = None
    # None: weights stored in a float dtype; else how the checkpoint's FP8 weights are scaled
    quant: FP8BlockQuant | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        assert self.num_layers == len(self.moe_layers), f"{self.num_layers=} {len(self.moe_layers)=}"
        assert self.num_heads % self.num_kv_heads == 0, f"{self.num_heads=} {self.num_kv_heads=}"
        assert self.attention in ("mha", "mla"), self.attention
        assert self.qk_norm in ("none", "head", "full"), self.qk_norm
        assert self.scoring in ("softmax", "sigmoid"), self.scoring
        if self.num_experts:
            assert 0 < self.top_k <= self.num_experts, f"{self.top_k=} {self.num_experts=}"
            assert self.num_experts % self.n_group == 0, f"{self.num_experts=} {self.n_group=}"

    @property
    def moe_layer_ids(self) -> list[int]:
        return [i for i, m in enumerate(self.moe_layers) if m]

    @property
    def q_head_dim(self) -> int:
        """Per-head width of queries and keys."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.attention == "mla" else self.head_dim

    @property
    def kv_heads_cached(self) -> int:
        """Heads of the per-head K/V cache layout (MLA caches a latent instead: KVCacheSpec.values_per_token)."""
        return self.num_heads if self.attention == "mla" else self.num_kv_heads

    @property
    def v_dim(self) -> int:
        return self.v_head_dim if self.attention == "mla" else self.head_dim

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        model_type = raw.get("model_type")
        parser = _PARSERS.get(str(model_type))
        if parser is None:
            raise ConfigError(
                f"unsupported model_type {model_type!r}; supported: {', '.join(sorted(_PARSERS))}"
            )
        # NOTE: checked before any architecture-specific field, for every model_type: a
        # quantisation this code does not implement must never load as if it were plain weights
        try:
            quant = parse_quantization(raw)
        except QuantizationError as e:
            raise ConfigError(f"{model_type}: {e}") from e
        return replace(parser(raw), quant=quant)

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        cfg_path = Path(path) / "config.json"
        if not cfg_path.is_file():
            raise ConfigError(f"{cfg_path} not found: a checkpoint directory needs an HF config.json")
        return cls.from_dict(json.loads(cfg_path.read_text()))


# ---------------------------------------------------------------- parsing helpers


def _require(raw: dict[str, Any], key: str) -> Any:
    if raw.get(key) is None:
        raise ConfigError(f"{raw.get('model_type')}: config field {key!r} is required")
    return raw[key]


def _reject(raw: dict[str, Any], key: str, allowed: Callable[[Any], bool], why: str) -> None:
    if key in raw and not allowed(raw[key]):
        raise ConfigError(f"{raw.get('model_type')}: unsupported config {key}={raw[key]!r} ({why})")


def _rope(raw: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) read the way HF standardises ``rope_parameters``/``rope_scaling``."""
    mt = raw.get("model_type")
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    rope_type = params.get("rope_type") or params.get("type") or "default"
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    if rope_type not in ROPE_TYPES:
        why = {
            "dynamic": "HF recomputes dynamic-NTK frequencies from the longest sequence of each "
            "forward call, which a batching server cannot reproduce per request",
        }.get(rope_type, f"implemented rope types: {', '.join(ROPE_TYPES)}")
        raise ConfigError(f"{mt}: unsupported config rope_type={rope_type!r} ({why})")
    if rope_type == "default":
        return theta, None
    factor = params.get("factor")
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or factor <= 0:
        raise ConfigError(f"{mt}: rope_type={rope_type!r} needs a positive numeric factor, got {factor!r}")
    if rope_type == "linear":
        return theta, RopeScaling("linear", float(factor))
    # HF: a top-level original_max_position_embeddings wins over the one in the rope dict, and
    # with neither the model's own max_position_embeddings is the original length
    orig = raw.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
    orig = int(orig or raw.get("max_position_embeddings", 4096))

    def opt(key: str) -> float | None:
        v = params.get(key)
        return None if v is None else float(v)

    return theta, RopeScaling(
        "yarn",
        float(factor),
        original_max_position_embeddings=orig,
        # HF: `beta_fast or 32`, `beta_slow or 1` (a zero means the default)
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        mscale=opt("mscale"),
        mscale_all_dim=opt("mscale_all_dim"),
        attention_factor=opt("attention_factor"),
        truncate=bool(params.get("truncate", True)),
    )


def _eos(raw: dict[str, Any]) -> tuple[int, ...]:
    eos = raw.get("eos_token_id")
    if eos is None:
        return ()
    ids = (eos,) if isinstance(eos, int) else tuple(eos)
    return tuple(int(i) for i in ids if 0 <= int(i) < int(raw["vocab_size"]))


def _common(raw: dict[str, Any], head_dim: int | None = None) -> dict[str, Any]:
    _reject(raw, "hidden_act", lambda v: v == "silu", "only SiLU experts are implemented")
    _reject(raw, "mlp_bias", lambda v: not v, "MLP biases are not implemented")
    _reject(raw, "pretraining_tp", lambda v: v in (None, 1), "tensor-parallel pretraining split")
    heads = int(_require(raw, "num_attention_heads"))
    hidden = int(_require(raw, "hidden_size"))
    theta, scaling = _rope(raw)
    return dict(
        model_type=raw["model_type"],
        vocab_size=int(_require(raw, "vocab_size")),
        hidden_size=hidden,
        num_layers=int(_require(raw, "num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(head_dim or raw.get("head_dim") or hidden // heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        intermediate_size=int(raw.get("intermediate_size") or 0),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_eos(raw),
    )


def _no_sliding_window(raw: dict[str, Any]) -> None:
    if raw.get("use_sliding_window") or (raw.get("model_type") == "mixtral" and raw.get("sliding_window")):
        raise ConfigError(
            f"{raw['model_type']}: unsupported config sliding_window={raw.get('sliding_window')!r}"
        )


def _qwen_moe_layers(raw: dict[str, Any], num_experts: int) -> tuple[bool, ...]:
    step = int(raw.get("decoder_sparse_step", 1))
    dense = set(raw.get("mlp_only_layers") or [])
    n = int(raw["num_hidden_layers"])
    return tuple(num_experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(n))


def _parse_qwen3_moe(raw: dict[str, Any]) -> ModelConfig:
    _no_sliding_window(raw)
    _reject(raw, "attention_bias", lambda v: not v, "Qwen3-MoE checkpoints have no attention bias")
    e = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
    return ModelConfig(
        **_common(raw),
        qk_norm="head",
        num_experts=e,
        top_k=int(_require(raw, "num_experts_per_tok")),
        moe_intermediate_size=int(_require(raw, "moe_intermediate_size")),
        moe_layers=_qwen_moe_layers(raw, e),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
    )


def _parse_qwen2_moe(raw: dict[str, Any]) -> ModelConfig:
    _no_sliding_window(raw)
    e = int(_require(raw, "num_experts"))
    return ModelConfig(
        **_common(raw),
        qkv_bias=bool(raw.get("qkv_bias", True)),
        num_experts=e,
        top_k=int(_require(raw, "num_experts_per_tok")),
        moe_intermediate_size=int(_require(raw, "moe_intermediate_size")),
        moe_layers=_qwen_moe_layers(raw, e),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0),
        shared_expert_gate=True,
    )


def _parse_mixtral(raw: dict[str, Any]) -> ModelConfig:
    _no_sliding_window(raw)
    e = int(_require(raw, "num_local_experts"))
    return ModelConfig(
        **_common(raw),
        num_experts=e,
        top_k=int(_require(raw, "num_experts_per_tok")),
        moe_intermediate_size=int(_require(raw, "intermediate_size")),
        moe_layers=(True,) * int(raw["num_hidden_layers"]),
        norm_topk_prob=True,
    )


def _parse_olmoe(raw: dict[str, Any]) -> ModelConfig:
    e = int(_require(raw, "num_experts"))
    clip = raw.get("clip_qkv")
    return ModelConfig(
        **_common(raw),
        qkv_bias=bool(raw.get("attention_bias", False)),
        o_bias=bool(raw.get("attention_bias", False)),
        qk_norm="full",
        clip_qkv=None if clip is None else float(clip),
        num_experts=e,
        top_k=int(_require(raw, "num_experts_per_tok")),
        moe_intermediate_size=int(_require(raw, "intermediate_size")),
        moe_layers=(True,) * int(raw["num_hidden_layers"]),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
    )


# HF transformers' defaults for the DeepSeek fields a config.json may leave out; they differ
# between the versions (a missing field must mean what it means to HF, not 0 or None).
_DEEPSEEK_DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v2": dict(
        q_lora_rank=1536,
        first_k_dense_replace=0,
        n_shared_experts=2,
        routed_scaling_factor=1.0,
        topk_method="greedy",
        n_group=None,
        topk_group=None,
    ),
    "deepseek_v3": dict(
        q_lora_rank=1536,
        first_k_dense_replace=3,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        n_group=8,
        topk_group=4,
        norm_topk_prob=True,
        rope_interleave=True,
    ),
}


def _deepseek_field(raw: dict[str, Any], key: str, nullable: bool = False) -> Any:
    value = raw[key] if key in raw else _DEEPSEEK_DEFAULTS[raw["model_type"]][key]
    if value is None and not nullable:
        raise ConfigError(f"{raw['model_type']}: config field {key!r} must not be null")
    return value


def _deepseek_routing(raw: dict[str, Any]) -> dict[str, Any]:
    """The router rule of a DeepSeek checkpoint, as HF transformers implements it.

    HF hard-codes one rule per version (V2: softmax, greedy or group-limited greedy, never
    renormalised; V3: sigmoid + correction bias, noaux_tc, optionally renormalised) and ignores
    ``scoring_func``/``topk_method`` where it does not branch on them, so a config naming another
    rule is refused rather than served with a different one.
    """
    mt = raw["model_type"]
    if mt == "deepseek_v3":
        _reject(raw, "topk_method", lambda v: v in (None, "noaux_tc"), "DeepSeek-V3 routes with noaux_tc")
        _reject(raw, "scoring_func", lambda v: v in (None, "sigmoid"), "DeepSeek-V3 scores with sigmoid")
        method, scoring, norm = (
            "noaux_tc",
            "sigmoid",
            bool(_deepseek_field(raw, "norm_topk_prob", nullable=True)),
        )
    else:
        _reject(raw, "scoring_func", lambda v: v in (None, "softmax"), "DeepSeek-V2 scores with softmax")
        # NOTE: DeepSeek's own V2 code renormalises (and then skips the scaling factor) when this
        # is set, HF's ignores it: there is no single right answer to serve.
        _reject(raw, "norm_topk_prob", lambda v: not v, "HF's DeepSeek-V2 never renormalises")
        method, scoring, norm = _deepseek_field(raw, "topk_method"), "softmax", False
        if method not in ("greedy", "group_limited_greedy"):
            raise ConfigError(f"{mt}: unsupported config topk_method={method!r}")
    e, k = int(_require(raw, "n_routed_experts")), int(_require(raw, "num_experts_per_tok"))
    groups, topk_groups = 1, 1
    if method != "greedy":
        groups = int(_deepseek_field(raw, "n_group"))
        topk_groups = int(_deepseek_field(raw, "topk_group"))
        per_group = e // groups if groups > 0 and e % groups == 0 else 0
        # noaux_tc ranks a group by its two best experts
        if not per_group or per_group < (2 if method == "noaux_tc" else 1):
            raise ConfigError(f"{mt}: unsupported config n_group={groups} for {e} routed experts")
        if not 0 < topk_groups <= groups or k > topk_groups * per_group:
            raise ConfigError(
                f"{mt}: unsupported config topk_group={topk_groups} (n_group={groups}, "
                f"num_experts_per_tok={k}: the kept groups must hold the top-k)"
            )
    return dict(
        num_experts=e,
        top_k=k,
        scoring=scoring,
        norm_topk_prob=norm,
        routed_scaling_factor=float(_deepseek_field(raw, "routed_scaling_factor")),
        topk_method=method,
        n_group=groups,
        topk_group=topk_groups,
        correction_bias=method == "noaux_tc",
    )


def _parse_deepseek(raw: dict[str, Any]) -> ModelConfig:
    mt = raw["model_type"]
    heads = int(_require(raw, "num_attention_heads"))
    _reject(raw, "attention_bias", lambda v: not v, "MLA projections have no bias here")
    _reject(raw, "num_key_value_heads", lambda v: v in (None, heads), "MLA expands K/V for every query head")
    _reject(raw, "moe_layer_freq", lambda v: v == 1, "HF makes every layer from first_k_dense_replace on MoE")
    shared = _deepseek_field(raw, "n_shared_experts", nullable=True)
    if not shared:
        raise ConfigError(f"{mt}: unsupported config n_shared_experts={shared!r} (HF always builds them)")
    first_dense = int(_deepseek_field(raw, "first_k_dense_replace"))
    q_lora = _deepseek_field(raw, "q_lora_rank", nullable=True)
    rope = int(_require(raw, "qk_rope_head_dim"))
    moe_inter = int(_require(raw, "moe_intermediate_size"))
    n = int(_require(raw, "num_hidden_layers"))
    v3 = mt == "deepseek_v3"
    return ModelConfig(
        **_common(raw, head_dim=rope),
        attention="mla",
        q_lora_rank=None if q_lora is None else int(q_lora),
        kv_lora_rank=int(_require(raw, "kv_lora_rank")),
        qk_nope_head_dim=int(_require(raw, "qk_nope_head_dim")),
        qk_rope_head_dim=rope,
        v_head_dim=int(_require(raw, "v_head_dim")),
        # V2 rotates adjacent pairs (HF does it with complex numbers); V3 says which layout
        rope_interleave=bool(_deepseek_field(raw, "rope_interleave", nullable=True)) if v3 else True,
        moe_intermediate_size=moe_inter,
        moe_layers=tuple(i >= first_dense for i in range(n)),
        shared_expert_intermediate_size=int(shared) * moe_inter,
        **_deepseek_routing(raw),
        # DeepSeek-V3 checkpoints carry multi-token-prediction layers after the last decoder
        # layer; HF does not build them and neither do we (the loader skips their tensors)
        extra={"num_mtp_layers": int(raw.get("num_nextn_predict_layers") or 0) if v3 else 0},
    )


def _parse_kimi_k2(raw: dict[str, Any]) -> ModelConfig:
    """Kimi-K2 publishes ``model_type: kimi_k2`` on a DeepSeek-V3 architecture
    (``architectures: [DeepseekV3ForCausalLM]``): parsed and served as DeepSeek-V3."""
    cfg = _parse_deepseek({**raw, "model_type": "deepseek_v3"})
    return replace(cfg, extra={**cfg.extra, "hf_model_type": raw["model_type"]})


_PARSERS: dict[str, Callable[[dict[str, Any]], ModelConfig]] = {
    "qwen3_moe": _parse_qwen3_moe,
    "qwen2_moe": _parse_qwen2_moe,
    "mixtral": _parse_mixtral,
    "olmoe": _parse_olmoe,
    "deepseek_v2": _parse_deepseek,
    "deepseek_v3": _parse_deepseek,
    "kimi_k2": _parse_kimi_k2,
}


def cut_layers(cfg: ModelConfig) -> ModelConfig:
    """``cfg`` with its first layers only: up to its first MoE layer and its first dense one
    (each kind of layer once; a compile warm-up's model, coordinator/model/compile_ahead.py)."""
    kinds = [cfg.moe_layers.index(kind) for kind in (True, False) if kind in cfg.moe_layers]
    n = max(kinds) + 1
    return replace(cfg, num_layers=n, moe_layers=cfg.moe_layers[:n])
