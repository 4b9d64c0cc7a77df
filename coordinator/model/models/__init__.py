"""The model zoo: one module per architecture (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE,
DeepSeek-V2/V3), each defined explicitly and registered here by its HF ``model_type``; the
shared pieces are ``base.py`` (the decoder stack), ``attention.py`` and ``mla.py``, ``moe.py``
(router + routed experts through the dispatcher), ``layers.py`` and ``rope.py``."""

from __future__ import annotations

from collections.abc import Callable

import torch

from coordinator.model.models import deepseek, mixtral, olmoe, qwen2_moe, qwen3_moe
from coordinator.model.models.base import CausalLM
from expertmesh.config import ConfigError, ModelConfig

Builder = Callable[[ModelConfig, torch.dtype], CausalLM]

REGISTRY: dict[str, Builder] = {
    "qwen3_moe": qwen3_moe.build,
    "qwen2_moe": qwen2_moe.build,
    "mixtral": mixtral.build,
    "olmoe": olmoe.build,
    "deepseek_v2": deepseek.build_v2,
    "deepseek_v3": deepseek.build_v3,
}


def build_model(cfg: ModelConfig, dtype: torch.dtype) -> CausalLM:
    """Builds the structure on the meta device (no memory); the loader fills it."""
    builder = REGISTRY.get(cfg.model_type)
    if builder is None:
        raise ConfigError(f"no model builder for model_type {cfg.model_type!r}")
    with torch.device("meta"):
        return builder(cfg, dtype)
