"""A PEFT ``adapter_config.json``: the fields MoE-LoRA serving uses, and refusals of the rest.

Ranks and alphas resolve per module as PEFT resolves them (``rank_pattern`` / ``alpha_pattern``
keys matched against the end of the module name, first match wins; otherwise ``r`` /
``lora_alpha``); the scaling is ``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class AdapterError(ValueError):
    """The adapter cannot be served: unsupported, malformed, or not made for this model."""


def _pattern_key(patterns: dict[str, Any], name: str) -> str | None:
    # same rule as peft.utils.other.get_pattern_key: the pattern must match a dotted suffix
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", name):
            return key
    return None


@dataclass(frozen=True)
class AdapterConfig:
    r: int
    lora_alpha: float
    use_rslora: bool = False
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    target_parameters: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.r <= 0:
            raise AdapterError(f"adapter_config.json: r must be positive, got {self.r}")

    def rank(self, module: str) -> int:
        key = _pattern_key(self.rank_pattern, module)
        return int(self.rank_pattern[key]) if key is not None else self.r

    def scaling(self, module: str, rank: int) -> float:
        key = _pattern_key(self.alpha_pattern, module)
        alpha = float(self.alpha_pattern[key]) if key is not None else float(self.lora_alpha)
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank

    @staticmethod
    def from_dict(raw: dict[str, Any]) -> AdapterConfig:
        if raw.get("peft_type", "LORA") != "LORA":
            raise AdapterError(f"adapter_config.json: peft_type {raw.get('peft_type')!r} is not LORA")
        refusals = {
            "use_dora": "DoRA adapters are not supported",
            "modules_to_save": "modules_to_save (fully trained copies of modules) is not supported",
            "trainable_token_indices": "trainable token embeddings are not supported",
            "lora_bias": "LoRA B biases are not supported",
            "fan_in_fan_out": "fan_in_fan_out (Conv1D layers) is not supported",
            "use_qalora": "QALoRA is not supported",
        }
        for key, why in refusals.items():
            if raw.get(key):
                raise AdapterError(f"adapter_config.json: {key}={raw[key]!r}: {why}")
        if raw.get("bias", "none") != "none":
            raise AdapterError(f"adapter_config.json: bias={raw['bias']!r}: trained biases are not supported")
        for key in ("lora_ga_config", "velora_config", "kasa_config", "arrow_config", "megatron_config"):
            if raw.get(key):
                raise AdapterError(f"adapter_config.json: {key} is set: this LoRA variant is not supported")
        try:
            return AdapterConfig(
                r=int(raw["r"]),
                lora_alpha=float(raw.get("lora_alpha", raw["r"])),
                use_rslora=bool(raw.get("use_rslora", False)),
                rank_pattern={str(k): int(v) for k, v in (raw.get("rank_pattern") or {}).items()},
                alpha_pattern={str(k): float(v) for k, v in (raw.get("alpha_pattern") or {}).items()},
                target_parameters=tuple(raw.get("target_parameters") or ()),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise AdapterError(f"adapter_config.json: bad or missing field: {e}") from e

    @staticmethod
    def from_dir(path: Path) -> AdapterConfig:
        file = path / "adapter_config.json"
        if not file.is_file():
            raise AdapterError(f"{path}: no adapter_config.json")
        try:
            raw = json.loads(file.read_text())
        except json.JSONDecodeError as e:
            raise AdapterError(f"{file}: not valid JSON: {e}") from e
        if not isinstance(raw, dict):
            raise AdapterError(f"{file}: expected a JSON object")
        return AdapterConfig.from_dict(raw)
