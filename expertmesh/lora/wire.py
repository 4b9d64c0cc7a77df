"""MoE-LoRA adapter weights on the wire (``LoadAdapterRequest.tensors``), both directions.

Per MoE layer l, five tensors: ``{l}.experts`` int32 [E'] (the logical experts this copy covers:
those the receiving server holds), ``{l}.a13`` [E', R13, H], ``{l}.b13`` [E', 2I, R13],
``{l}.a2`` [E', R2, I], ``{l}.b2`` [E', H, R2] (scaling already folded into B, so the message's
``scaling`` is 1). The receiver checks every shape against its model before keeping anything.
"""

from __future__ import annotations

import torch

from expertmesh import wire
from expertmesh.lora.moe import ExpertLoRA
from expertmesh.lora.store import LayerAdapter
from expertmesh.v1 import tensor_pb2

_PARTS = ("a13", "b13", "a2", "b2")


def encode_adapter(layers: dict[int, LayerAdapter], dtype: torch.dtype) -> dict[str, tensor_pb2.Tensor]:
    out: dict[str, tensor_pb2.Tensor] = {}
    for layer, la in layers.items():
        out[f"{layer}.experts"] = wire.encode(torch.tensor(la.experts, dtype=torch.int32))
        for part in _PARTS:
            out[f"{layer}.{part}"] = wire.encode(getattr(la.lora, part).to(dtype).contiguous())
    return out


def decode_adapter(
    tensors, hidden: int, inter: int, num_experts: int, moe_layers: list[int], dtype: torch.dtype
) -> dict[int, LayerAdapter]:
    """Raises ValueError naming the tensor for anything that does not fit the model."""
    layers: dict[int, dict[str, torch.Tensor]] = {}
    for key, msg in tensors.items():
        layer_s, _, part = key.partition(".")
        if not layer_s.isdigit() or part not in ("experts", *_PARTS):
            raise ValueError(f"adapter tensor {key!r}: expected '<layer>.experts|a13|b13|a2|b2'")
        layers.setdefault(int(layer_s), {})[part] = wire.decode(msg, key)
    out: dict[int, LayerAdapter] = {}
    for layer, parts in sorted(layers.items()):
        if layer not in moe_layers:
            raise ValueError(f"adapter layer {layer} is not an MoE layer of this model ({moe_layers})")
        missing = [p for p in ("experts", *_PARTS) if p not in parts]
        if missing:
            raise ValueError(f"adapter layer {layer}: missing {missing}")
        experts = parts["experts"]
        if experts.dtype != torch.int32 or experts.dim() != 1:
            raise ValueError(
                f"adapter layer {layer}: experts must be int32 [E'], got {experts.dtype} {list(experts.shape)}"
            )
        ids = experts.tolist()
        if any(not 0 <= e < num_experts for e in ids) or len(set(ids)) != len(ids):
            raise ValueError(
                f"adapter layer {layer}: expert ids {ids} out of range [0, {num_experts}) or repeated"
            )
        n = len(ids)
        if parts["a13"].dim() != 3 or parts["a2"].dim() != 3:
            raise ValueError(f"adapter layer {layer}: a13 and a2 must be 3-D [E', R, in]")
        r13, r2 = parts["a13"].shape[1], parts["a2"].shape[1]
        want = {
            "a13": (n, r13, hidden),
            "b13": (n, 2 * inter, r13),
            "a2": (n, r2, inter),
            "b2": (n, hidden, r2),
        }
        for p, shape in want.items():
            if tuple(parts[p].shape) != shape or not parts[p].is_floating_point():
                raise ValueError(
                    f"adapter layer {layer} {p}: {parts[p].dtype} {list(parts[p].shape)}, expected float {list(shape)}"
                )
        lora = ExpertLoRA(*(parts[p].to(dtype) for p in _PARTS))
        out[layer] = LayerAdapter(tuple(ids), lora)
    return out
