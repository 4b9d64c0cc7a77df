"""Kernel launch configurations: tuned tables per GPU, and a default for shapes nobody tuned.

A table lives in ``configs/<gpu name>.json`` (the name as torch reports it, spaces -> '_'),
written by ``python -m gpu_server.kernels.tune``. It maps a shape key ``H{H}_I{I}`` to token-count
buckets; a lookup takes the bucket nearest T on a log scale. ``block_m`` is shared by both GEMMs
because the alignment pads each slot's rows to it.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import triton

CONFIG_DIR = Path(__file__).parent / "configs"


@dataclass(frozen=True)
class GemmConfig:
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        for v in (self.block_n, self.block_k):
            assert v >= 16 and v & (v - 1) == 0, f"block sizes must be powers of two >= 16: {self}"


@dataclass(frozen=True)
class MoeConfig:
    block_m: int
    gate_up: GemmConfig
    down: GemmConfig

    def __post_init__(self):
        assert self.block_m in (16, 32, 64, 128, 256), f"{self.block_m=}"

    def fitted(self, itemsize: int) -> MoeConfig:
        """This config with tiles that fit in shared memory for elements of ``itemsize`` bytes."""
        return MoeConfig(
            self.block_m,
            fit_shared_memory(self.gate_up, self.block_m, 2, itemsize),
            fit_shared_memory(self.down, self.block_m, 1, itemsize),
        )

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> MoeConfig:
        return cls(d["block_m"], GemmConfig(**d["gate_up"]), GemmConfig(**d["down"]))


def default_config(num_tokens: int, top_k: int, num_slots: int) -> MoeConfig:
    """A reasonable config from the expected rows per slot (uniform routing)."""
    rows_per_slot = max(1, num_tokens * top_k // max(1, num_slots))
    if rows_per_slot <= 16:
        # decode: streaming weights; narrow tiles give enough programs to fill the chip
        small = GemmConfig(block_n=64, block_k=128, group_m=1, num_warps=4, num_stages=4)
        return MoeConfig(16, small, small)
    if rows_per_slot <= 64:
        mid = GemmConfig(block_n=64, block_k=128, group_m=8, num_warps=4, num_stages=4)
        return MoeConfig(triton.next_power_of_2(rows_per_slot), mid, mid)
    big = GemmConfig(block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=3)
    return MoeConfig(128 if rows_per_slot > 128 else 64, big, big)


# NOTE: below the 227 KiB a Hopper block may use, leaving room for Triton's own layouts
SHARED_MEMORY_BUDGET = 200 * 1024


def fit_shared_memory(cfg: GemmConfig, block_m: int, b_tiles: int, itemsize: int) -> GemmConfig:
    """Shrink stages, then block_k, until the pipelined A and B tiles fit (fp32 needs this)."""

    def need(c: GemmConfig) -> int:
        return c.num_stages * (block_m + b_tiles * c.block_n) * c.block_k * itemsize

    while need(cfg) > SHARED_MEMORY_BUDGET and (cfg.num_stages > 2 or cfg.block_k > 32):
        if cfg.num_stages > 2:
            cfg = replace(cfg, num_stages=cfg.num_stages - 1)
        else:
            cfg = replace(cfg, block_k=cfg.block_k // 2)
    return cfg


def shape_key(hidden: int, inter: int) -> str:
    return f"H{hidden}_I{inter}"


@dataclass(frozen=True)
class ConfigTable:
    """Tuned configs for one GPU: shape key -> {bucket T: MoeConfig}."""

    gpu: str
    shapes: dict[str, dict[int, MoeConfig]]

    def lookup(self, hidden: int, inter: int, num_tokens: int, top_k: int, num_slots: int) -> MoeConfig:
        buckets = self.shapes.get(shape_key(hidden, inter))
        if not buckets:
            return default_config(num_tokens, top_k, num_slots)
        lt = math.log(max(1, num_tokens))
        nearest = min(buckets, key=lambda b: (abs(math.log(b) - lt), -b))
        return buckets[nearest]

    @classmethod
    def empty(cls) -> ConfigTable:
        return cls("none", {})

    @classmethod
    def load(cls, path: Path) -> ConfigTable:
        d = json.loads(path.read_text())
        shapes = {
            key: {int(t): MoeConfig.from_json(c) for t, c in buckets.items()}
            for key, buckets in d["shapes"].items()
        }
        return cls(d["gpu"], shapes)

    def save(self, path: Path) -> None:
        # one line per bucket: diffs of a re-tune stay readable
        lines = []
        for key, buckets in sorted(self.shapes.items()):
            rows = [f'    "{t}": {json.dumps(c.to_json())}' for t, c in sorted(buckets.items())]
            lines.append(f'  "{key}": {{\n' + ",\n".join(rows) + "\n  }")
        text = f'{{\n "gpu": {json.dumps(self.gpu)},\n "shapes": {{\n' + ",\n".join(lines) + "\n }\n}\n"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def gpu_file_name(device_name: str) -> str:
    return device_name.strip().replace(" ", "_") + ".json"


def table_for_gpu(device_name: str) -> ConfigTable:
    """The tuned table for this GPU, or an empty one (every lookup then takes the default)."""
    path = CONFIG_DIR / gpu_file_name(device_name)
    return ConfigTable.load(path) if path.exists() else ConfigTable.empty()
