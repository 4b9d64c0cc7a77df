"""The expert backend interface and its plain-torch reference.

Every place that computes routed experts (the in-process engine, the CPU expert server, the GPU
expert server) holds each MoE layer's experts as stacked slot tensors and calls one function:

    out[t] = sum_k weights[t, k] * expert_{slot_ids[t, k]}(x[t])      (slot -1: skipped)

with expert_s(x) = W2[s] @ (silu(W1[s] x) * (W3[s] x)), W1/W3 merged into ``w13``.

Shapes: T tokens, K top-k, H hidden, I expert intermediate size, S local slots.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F

from expertmesh.lora.moe import LoRABatch, moe_lora_reference


class ExpertBackend(ABC):
    """Computes the weighted sum of routed experts for a batch of tokens."""

    name: str = "abstract"
    # dtype the routed experts are resident in when it is not the compute dtype (FP8)
    weight_dtype: str = ""

    def pack_weights(self, w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[S, 2I, H], [S, H, I] -> what ``forward`` takes as w13, w2 (called at load, not per step).

        A backend with its own layout (interleaved, quantised) packs here; its packed tensors keep
        the slot as dim 0 so a slot table can index and stack them. Default: unchanged.
        """
        return w13, w2

    @abstractmethod
    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        w13: torch.Tensor,  # [S, 2I, H]
        w2: torch.Tensor,  # [S, H, I]
        slot_ids: torch.Tensor,  # [T, K] int, -1 = not here
        weights: torch.Tensor,  # [T, K] routing weights
        lora: LoRABatch | None = None,  # MoE LoRA (expertmesh/lora): per-token adapters
    ) -> torch.Tensor:  # [T, H], dtype of x
        ...


def torch_moe(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """Reference: a loop over the slots that received tokens (HF's summation order)."""
    out = torch.zeros_like(x)  # [T, H]
    if x.shape[0] == 0:
        return out
    inter = w2.shape[2]
    for s in torch.unique(slot_ids[slot_ids >= 0]).tolist():
        kpos, tok = torch.where(slot_ids.t() == s)  # [n], [n]  (k-major: HF's row order)
        gate_up = F.linear(x[tok], w13[s])  # [n, 2I]
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]  # [n, I]
        # NOTE: weights are float32; the product rounds once to x's dtype
        y = F.linear(act, w2[s]) * weights[tok, kpos, None].float()  # [n, H]
        out.index_add_(0, tok, y.to(out.dtype))
    return out


class TorchExpertBackend(ExpertBackend):
    """Plain torch on any device: the reference every other backend is checked against."""

    name = "torch"

    def forward(self, x, w13, w2, slot_ids, weights, lora=None):
        if lora is not None:
            return moe_lora_reference(x, w13, w2, slot_ids, weights, lora.weights, lora.token_adapter)
        return torch_moe(x, w13, w2, slot_ids, weights)
