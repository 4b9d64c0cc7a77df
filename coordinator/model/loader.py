"""Fills a meta-device model from a checkpoint's non-expert tensors.

Checkpoint names map onto parameters one to one, except merged projections: ``q_proj``,
``k_proj``, ``v_proj`` land in rows of ``qkv_proj`` and ``gate_proj``/``up_proj`` in
``gate_up_proj`` (see :class:`~coordinator.model.models.layers.MergedLinear`). Every parameter must
be filled exactly; anything missing or mis-shaped is a :class:`CheckpointError` naming it.
FP8 block-quantised weights arrive dequantised from the reader and are cast to the model dtype;
DeepSeek's multi-token-prediction layers are skipped with a log line.
"""

from __future__ import annotations

import logging
import re

import torch
from torch import nn

from coordinator.model.models import build_model
from coordinator.model.models.base import CausalLM
from coordinator.model.models.layers import MergedLinear
from expertmesh.checkpoint import CheckpointError, CheckpointReader
from expertmesh.progress import LoadProgress

log = logging.getLogger(__name__)

_IGNORED = ("rotary_emb.inv_freq",)
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _is_mtp(name: str, num_layers: int, num_mtp_layers: int) -> bool:
    """A tensor of the multi-token-prediction layers that follow the decoder (DeepSeek-V3)."""
    m = _LAYER.match(name)
    return m is not None and num_layers <= int(m.group(1)) < num_layers + num_mtp_layers


def _slots(model: nn.Module) -> dict[str, tuple[str, slice | None, tuple[int, ...]]]:
    """Every checkpoint name the model expects -> (parameter, row slice or None, shape)."""
    out: dict[str, tuple[str, slice | None, tuple[int, ...]]] = {}
    merged: set[str] = set()
    for path, mod in model.named_modules():
        if not isinstance(mod, MergedLinear):
            continue
        parent = path.rpartition(".")[0]
        for leaf, param in mod.named_parameters(recurse=False):
            merged.add(f"{path}.{leaf}")
            for part in mod.parts:
                start, rows = mod.part_rows(part)
                shape = (rows, *param.shape[1:])
                out[f"{parent}.{part}.{leaf}"] = (f"{path}.{leaf}", slice(start, start + rows), shape)
    for name, param in model.named_parameters(remove_duplicate=False):
        if name not in merged:
            out[name] = (name, None, tuple(param.shape))
    return out


def _target(
    reader: CheckpointReader,
    ck_name: str,
    expected: dict[str, tuple[str, slice | None, tuple[int, ...]]],
    params: dict[str, nn.Parameter],
    seen: set[str],
) -> tuple[str, torch.Tensor]:
    """Where checkpoint tensor ``ck_name`` goes: its parameter, or its rows of a merged one."""
    name = ck_name.replace(".block_sparse_moe.", ".mlp.")
    if name not in expected:
        raise CheckpointError(
            f"checkpoint tensor {ck_name!r} has no place in the {reader.config.model_type} model"
        )
    pname, rows, shape = expected[name]
    dst = params[pname].data if rows is None else params[pname].data[rows]
    assert tuple(dst.shape) == shape, f"{ck_name}: {list(dst.shape)=} {list(shape)=}"
    seen.add(name)
    return ck_name, dst


def materialize(model: nn.Module, device: torch.device | str) -> None:
    """``model.to_empty(device=device)`` without its ``empty_like``: on meta tensors that runs
    torch's Python reference, which imports sympy (2.4 s in one py-spy sample of a fresh H200
    host's start; the start's total did not shrink by as much, benchmarks/RESULTS.md). A
    parameter or buffer shared by two modules stays one tensor."""
    new: dict[int, torch.Tensor] = {}
    for mod in model.modules():
        for table in (mod._parameters, mod._buffers):
            for name, t in list(table.items()):
                if t is None:
                    continue
                if id(t) not in new:
                    data = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
                    new[id(t)] = nn.Parameter(data, t.requires_grad) if isinstance(t, nn.Parameter) else data
                table[name] = new[id(t)]  # type: ignore[assignment]


def load_model(reader: CheckpointReader, dtype: torch.dtype, device: torch.device | str) -> CausalLM:
    model = build_model(reader.config, dtype)
    materialize(model, device)
    params = dict(model.named_parameters(remove_duplicate=False))
    expected = _slots(model)
    cfg = reader.config
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    mtp = int(cfg.extra.get("num_mtp_layers", 0))
    seen: set[str] = set()
    names = reader.non_expert_names()
    skipped = [n for n in names if _is_mtp(n, cfg.num_layers, mtp)]
    if skipped:
        log.info(
            "skipping %d tensors of %d multi-token-prediction layer(s) (model.layers.%d+): "
            "speculative-decoding weights this server does not use",
            len(skipped),
            mtp,
            cfg.num_layers,
        )
    names = [n for n in names if not n.endswith(_IGNORED) and not _is_mtp(n, cfg.num_layers, mtp)]
    progress = LoadProgress("coordinator weights", sum(reader.nbytes(n) for n in names))
    reader.progress = progress
    try:
        # straight from the files into the parameters, big tensors in pieces over several
        # threads (no full-precision copy; a stored shape other than the parameter's is a
        # CheckpointError naming both)
        reader.read_all([_target(reader, n, expected, params, seen) for n in names])
    finally:
        reader.progress = None
        progress.close()
    missing = [n for n in expected if n not in seen]
    if missing:
        listed = ", ".join(f"{n!r} (expected shape {list(expected[n][2])})" for n in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise CheckpointError(f"{reader.path}: missing tensors {listed}{more}")
    model.eval()
    return model
