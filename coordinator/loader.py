"""Fills a meta-device model from a checkpoint's non-expert tensors.

Checkpoint names map onto parameters one to one, except merged projections: ``q_proj``,
``k_proj``, ``v_proj`` land in rows of ``qkv_proj`` and ``gate_proj``/``up_proj`` in
``gate_up_proj`` (see :class:`~coordinator.models.layers.MergedLinear`). Every parameter must
be filled exactly; anything missing or mis-shaped is a :class:`CheckpointError` naming it.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from coordinator.models import build_model
from coordinator.models.base import CausalLM
from coordinator.models.layers import MergedLinear
from expertmesh.checkpoint import CheckpointError, CheckpointReader

_IGNORED = ("rotary_emb.inv_freq",)
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _is_mtp(name: str, num_layers: int, num_mtp_layers: int) -> bool:
    """A tensor of the multi-token-prediction layers that follow the decoder (DeepSeek-V3)."""
    m = _LAYER.match(name)
    return m is not None and num_layers <= int(m.group(1)) < num_layers + num_mtp_layers


def _target(model: nn.Module, name: str) -> tuple[str, slice | None]:
    """Checkpoint name -> (parameter name, row slice within it or None)."""
    name = name.replace(".block_sparse_moe.", ".mlp.")
    module_path, _, leaf = name.rpartition(".")  # leaf: weight | bias | e_score_correction_bias
    parent_path, _, proj = module_path.rpartition(".")
    if parent_path:
        try:
            parent = model.get_submodule(parent_path)
        except AttributeError:
            parent = None
        for child_name, child in parent.named_children() if parent is not None else ():
            if isinstance(child, MergedLinear) and proj in child.parts:
                start, rows = child.part_rows(proj)
                return f"{parent_path}.{child_name}.{leaf}", slice(start, start + rows)
    return name, None


def load_model(reader: CheckpointReader, dtype: torch.dtype, device: torch.device | str) -> CausalLM:
    model = build_model(reader.config, dtype)
    model.to_empty(device=device)
    params = dict(model.named_parameters(remove_duplicate=False))
    want_rows = {n: p.shape[0] if p.dim() else 1 for n, p in params.items()}
    filled: dict[str, int] = dict.fromkeys(params, 0)
    cfg = reader.config
    mtp = int(cfg.extra.get("num_mtp_layers", 0))
    for ck_name, tensor in reader.non_expert_tensors().items():
        if ck_name.endswith(_IGNORED) or _is_mtp(ck_name, cfg.num_layers, mtp):
            continue
        pname, rows = _target(model, ck_name)
        param = params.get(pname)
        if param is None:
            raise CheckpointError(
                f"checkpoint tensor {ck_name!r} has no place in the {reader.config.model_type} model"
            )
        dst = param.data if rows is None else param.data[rows]
        if tuple(dst.shape) != tuple(tensor.shape):
            raise CheckpointError(
                f"tensor {ck_name!r} has shape {list(tensor.shape)}, expected {list(dst.shape)}"
            )
        dst.copy_(tensor.to(dst.dtype))
        filled[pname] += dst.shape[0] if dst.dim() else 1
    if reader.config.tie_word_embeddings:
        filled["lm_head.weight"] = want_rows["lm_head.weight"]
    for pname, got in filled.items():
        if got != want_rows[pname]:
            raise CheckpointError(
                f"{reader.path}: tensor for parameter {pname!r} is missing "
                f"(expected shape {list(params[pname].shape)}, filled {got} of {want_rows[pname]} rows)"
            )
    model.eval()
    return model
