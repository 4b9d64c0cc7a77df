"""Lazy, by-name reading of HF safetensors checkpoints.

A checkpoint directory holds ``config.json`` and either ``model.safetensors`` or shards listed
in ``model.safetensors.index.json``. Tensors are opened lazily by name, so an expert server
reads only its own experts and the coordinator never reads a routed expert.

Routed experts are stored in one of three layouts, all handled by :meth:`expert_weights`:

* per expert: ``{prefix}.mlp.experts.{e}.{gate,up,down}_proj.weight``
* Mixtral per expert: ``{prefix}.block_sparse_moe.experts.{e}.{w1,w3,w2}.weight``
* fused: ``{prefix}.mlp.experts.gate_up_proj [E, 2I, H]`` and ``...down_proj [E, H, I]``

Shapes: E experts, H hidden, I expert intermediate size.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from expertmesh.config import ModelConfig

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# Tensor names that belong to routed experts (never loaded by the coordinator).
_ROUTED_EXPERT = re.compile(r"\.(mlp|block_sparse_moe)\.experts\.")


class CheckpointError(ValueError):
    """A tensor is missing or has the wrong shape."""


@dataclass(frozen=True)
class ExpertWeights:
    """One routed expert's weights: gate and up merged, as every backend wants them."""

    w13: torch.Tensor  # [2I, H]  rows 0..I-1 gate, I..2I-1 up
    w2: torch.Tensor  # [H, I]


class CheckpointReader:
    """Opens a checkpoint directory; reads tensors by name on demand."""

    def __init__(self, path: str | Path, config: ModelConfig | None = None) -> None:
        self.path = Path(path)
        self.config = config or ModelConfig.from_dir(self.path)
        self._file_of = self._index()
        self._handles: dict[str, object] = {}

    def _index(self) -> dict[str, str]:
        index = self.path / INDEX_FILE
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            return {str(k): str(v) for k, v in weight_map.items()}
        single = self.path / SINGLE_FILE
        if not single.is_file():
            raise CheckpointError(f"{self.path}: neither {INDEX_FILE} nor {SINGLE_FILE} found")
        with safe_open(str(single), "pt") as f:
            return {k: SINGLE_FILE for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict)

    def _handle(self, file: str):
        h = self._handles.get(file)
        if h is None:
            h = safe_open(str(self.path / file), "pt")
            self._handles[file] = h
        return h

    def names(self) -> Iterator[str]:
        return iter(self._file_of)

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """Reads one tensor; checks its shape when ``shape`` is given."""
        file = self._file_of.get(name)
        if file is None:
            want = f" (expected shape {list(shape)})" if shape is not None else ""
            raise CheckpointError(f"{self.path}: tensor {name!r} is missing{want}")
        t = self._handle(file).get_tensor(name)  # type: ignore[attr-defined]
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise CheckpointError(
                f"{self.path}: tensor {name!r} has shape {list(t.shape)}, expected {list(shape)}"
            )
        return t

    def get_slice(self, name: str, index: int, shape: tuple[int, ...]) -> torch.Tensor:
        """Reads ``tensor[index]`` of a stacked tensor without reading the rest of it."""
        file = self._file_of.get(name)
        if file is None:
            raise CheckpointError(f"{self.path}: tensor {name!r} is missing (expected [E, *{list(shape)}])")
        sl = self._handle(file).get_slice(name)  # type: ignore[attr-defined]
        full = tuple(sl.get_shape())
        if full[1:] != tuple(shape) or not 0 <= index < full[0]:
            raise CheckpointError(
                f"{self.path}: tensor {name!r} has shape {list(full)}, expected [>{index}, *{list(shape)}]"
            )
        return sl[index]

    # ------------------------------------------------------------ coordinator side

    def non_expert_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor except routed experts (the coordinator's share of the checkpoint)."""
        return {n: self.get(n) for n in self._file_of if not _ROUTED_EXPERT.search(n)}

    # ------------------------------------------------------------ expert server side

    def expert_weights(self, layer: int, expert: int) -> ExpertWeights:
        """Reads one routed expert of one layer (gate/up merged), touching nothing else."""
        cfg = self.config
        if not (0 <= layer < cfg.num_layers and cfg.moe_layers[layer]):
            raise CheckpointError(f"layer {layer} is not an MoE layer of this {cfg.model_type} model")
        if not 0 <= expert < cfg.num_experts:
            raise CheckpointError(f"expert {expert} out of range [0, {cfg.num_experts})")
        h, i = cfg.hidden_size, cfg.moe_intermediate_size
        base = f"model.layers.{layer}"
        fused = f"{base}.mlp.experts.gate_up_proj"
        if fused in self:
            w13 = self.get_slice(fused, expert, (2 * i, h))
            w2 = self.get_slice(f"{base}.mlp.experts.down_proj", expert, (h, i))
            return ExpertWeights(w13, w2)
        mixtral = f"{base}.block_sparse_moe.experts.{expert}"
        if f"{mixtral}.w1.weight" in self:
            names = (f"{mixtral}.w1.weight", f"{mixtral}.w3.weight", f"{mixtral}.w2.weight")
        else:
            p = f"{base}.mlp.experts.{expert}"
            names = (f"{p}.gate_proj.weight", f"{p}.up_proj.weight", f"{p}.down_proj.weight")
        gate, up = self.get(names[0], (i, h)), self.get(names[1], (i, h))
        return ExpertWeights(torch.cat([gate, up], 0), self.get(names[2], (h, i)))

    def close(self) -> None:
        self._handles.clear()
