"""The in-process routed experts of a CPU coordinator: fewer ops than the reference loop.

The reference (expertmesh.experts.torch_moe) runs about a dozen ops per hit expert; a decode
step of a small model does microseconds of arithmetic per op, so the op count is its cost. Two
paths, both summing each token's experts in HF's order (ascending expert id, each product
rounded to the activation dtype first, then added):

* small steps (every (token, k) pair's expert weights together under ``GATHER_BUDGET``
  elements): the pairs' weights gathered, two batched matmuls, one product per pair;
* larger ones: the reference's loop over hit experts, with the pairs sorted by expert once
  (one gather of the rows, per expert only its two matmuls, one scatter-add at the end); the
  same ops per expert as the reference, so the same numbers.

Shapes: T tokens, K top-k, N = T*K pairs, H hidden, I expert intermediate size, S slots.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from expertmesh.experts import ExpertBackend
from expertmesh.lora.moe import moe_lora_reference

# pairs x elements per expert up to which the gathered path runs. Measured on the 2-core VM, one
# thread: the demo model's 2..32 pairs (24576 elements each) take 0.35-0.6x the time of the
# sorted loop; past about 1M elements the copy of the weights costs more than the loop saves
# (at 512 hidden, 8 pairs of 393216 elements already take 1.5x)
GATHER_BUDGET = 1 << 20


def gathered_moe(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [S, 2I, H]
    w2: torch.Tensor,  # [S, H, I]
    slot_ids: torch.Tensor,  # [T, K], -1 = not here
    weights: torch.Tensor,  # [T, K] float32
) -> torch.Tensor:  # [T, H]
    t, k = slot_ids.shape
    h, inter = x.shape[1], w2.shape[2]
    if k > 2:  # two terms add alike in either order; more follow the experts' ascending order
        slot_ids, order = torch.sort(slot_ids, dim=1)
        weights = weights.gather(1, order)
    weights = weights.float()
    if int(slot_ids.min()) < 0:  # a -1 pair computes slot 0 and adds 0
        weights = weights.masked_fill(slot_ids < 0, 0.0)
        slot_ids = slot_ids.clamp(min=0)
    ids = slot_ids.reshape(-1)  # [N], token-major: a token's K experts are adjacent
    w13s = w13.index_select(0, ids).view(t, k * 2 * inter, h)  # [T, K*2I, H]
    gate_up = torch.bmm(x.unsqueeze(1), w13s.transpose(1, 2)).view(t * k, 2 * inter)  # [N, 2I]
    act = F.silu(gate_up.narrow(1, 0, inter)) * gate_up.narrow(1, inter, inter)  # [N, I]
    y = torch.bmm(act.unsqueeze(1), w2.index_select(0, ids).transpose(1, 2)).view(t, k, h)  # [T, K, H]
    # NOTE: weights are float32; each product rounds once to x's dtype, as the reference's
    y = (y * weights.unsqueeze(2)).to(x.dtype)
    out = y.select(1, 0)
    for j in range(1, k):
        out = out + y.select(1, j)
    return out


def sorted_moe(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [S, 2I, H]
    w2: torch.Tensor,  # [S, H, I]
    slot_ids: torch.Tensor,  # [T, K], -1 = not here
    weights: torch.Tensor,  # [T, K] float32
) -> torch.Tensor:  # [T, H]
    t = slot_ids.shape[0]
    inter = w2.shape[2]
    out = torch.zeros_like(x)
    flat = slot_ids.t().reshape(-1)  # [K*T] k-major: the reference's row order within an expert
    order = torch.argsort(flat, stable=True)  # [N] by expert; the -1 pairs first
    counts = torch.bincount(flat + 1, minlength=w13.shape[0] + 1).tolist()  # [1 + S]
    order = order[counts[0] :]  # [N'] pairs computed here
    if order.numel() == 0:
        return out
    tok = order % t  # [N']
    xs = x.index_select(0, tok)  # [N', H]
    ys = torch.empty_like(xs)
    start = 0
    for s, n in enumerate(counts[1:]):
        if n:
            gate_up = F.linear(xs[start : start + n], w13[s])  # [n, 2I]
            act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]  # [n, I]
            ys[start : start + n] = F.linear(act, w2[s])
            start += n
    w = weights.t().reshape(-1).float().index_select(0, order)  # [N']
    # NOTE: weights are float32; the product rounds once to x's dtype; index_add_ adds the rows
    # in order, so a token's experts in ascending order, as the reference's loop
    return out.index_add_(0, tok, (ys * w[:, None]).to(out.dtype))


class CPUExpertBackend(ExpertBackend):
    """The in-process engine's routed experts on the CPU (LocalDispatcher); LoRA steps take the
    reference."""

    name = "torch-cpu"

    def forward(self, x, w13, w2, slot_ids, weights, lora=None):
        if lora is not None:
            return moe_lora_reference(x, w13, w2, slot_ids, weights, lora.weights, lora.token_adapter)
        if x.shape[0] == 0:
            return torch.zeros_like(x)
        if slot_ids.numel() * (w13[0].numel() + w2[0].numel()) <= GATHER_BUDGET:
            return gathered_moe(x, w13, w2, slot_ids, weights)
        return sorted_moe(x, w13, w2, slot_ids, weights)
