"""The in-process routed experts of a CPU coordinator: fewer ops than the reference loop.

The reference (expertmesh.experts.torch_moe) runs about a dozen ops per hit expert; a decode
step of a small model does microseconds of arithmetic per op, so the op count is its cost. Two
paths, both summing each token's experts in HF's order (ascending expert id, each product
rounded to the activation dtype first, then added):

* small steps (every (token, k) pair's expert weights together under ``GATHER_BUDGET``
  elements): the pairs' weights gathered, two batched matmuls, one product per pair;
* larger ones: the pairs sorted by expert once (one gather of the rows, one scatter-add at the
  end), then either the reference's loop over hit experts with only their two matmuls each (the
  same ops per expert as the reference, so the same numbers), or, where few experts share many
  rows, every expert's rows padded to the busiest one's and two batched matmuls over them.

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

# the per-expert ops of the loop (about eight, tens of microseconds on one core) in weight
# elements of arithmetic they are worth: padding to the busiest slot is taken while the rows of
# zeros it adds cost less than this per hit expert. Measured (same VM): the demo model's 48 and
# 150-token steps take 0.6x and 0.8x the loop's time padded; at 128 experts of 512 x 128 the loop
# stays (padding a 512-token step there would take 1.2x)
PAD_OVERHEAD = 300_000


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
    pad: bool = True,
) -> torch.Tensor:  # [T, H]
    """The pairs sorted by expert, then either each hit expert's two matmuls (the reference's
    ops) or, when padding every slot's rows to the busiest one's wastes less arithmetic than
    the loop's per-expert ops cost (``pad``), two batched matmuls over all slots."""
    t = slot_ids.shape[0]
    slots, inter = w13.shape[0], w2.shape[2]
    out = torch.zeros_like(x)
    flat = slot_ids.t().reshape(-1)  # [K*T] k-major: the reference's row order within an expert
    order = torch.argsort(flat, stable=True)  # [N] by expert; the -1 pairs first
    counts = torch.bincount(flat + 1, minlength=slots + 1).tolist()  # [1 + S]
    skip, counts = counts[0], counts[1:]
    order = order[skip:]  # [N'] pairs computed here
    n = order.numel()
    if n == 0:
        return out
    tok = order % t  # [N']
    xs = x.index_select(0, tok)  # [N', H]
    busiest, hit = max(counts), sum(1 for c in counts if c)
    if pad and (slots * busiest - n) * (w13[0].numel() + w2[0].numel()) <= hit * PAD_OVERHEAD:
        ys = _padded(xs, w13, w2, counts, busiest)
    else:
        ys = torch.empty_like(xs)
        start = 0
        for s, c in enumerate(counts):
            if c:
                gate_up = F.linear(xs[start : start + c], w13[s])  # [c, 2I]
                act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]  # [c, I]
                ys[start : start + c] = F.linear(act, w2[s])
                start += c
    w = weights.t().reshape(-1).float().index_select(0, order)  # [N']
    # NOTE: weights are float32; the product rounds once to x's dtype; index_add_ adds the rows
    # in order, so a token's experts in ascending order, as the reference's loop
    return out.index_add_(0, tok, (ys * w[:, None]).to(out.dtype))


def _padded(
    xs: torch.Tensor,  # [N', H] rows sorted by slot
    w13: torch.Tensor,  # [S, 2I, H]
    w2: torch.Tensor,  # [S, H, I]
    counts: list[int],  # [S] rows of each slot
    busiest: int,  # C = max(counts)
) -> torch.Tensor:  # [N', H] each row's expert output
    """Every slot's rows padded with zeros to C: two batched matmuls over the slots, the
    weights used where they lie (no copy of them)."""
    slots, inter = w13.shape[0], w2.shape[2]
    first = [0] * slots  # each slot's first row in xs
    for s in range(1, slots):
        first[s] = first[s - 1] + counts[s - 1]
    slot = torch.repeat_interleave(torch.tensor(counts))  # [N'] slot of each row
    # row r of slot s, the (r - first[s])-th of its slot, goes to s * C + that
    dest = slot * busiest + torch.arange(slot.shape[0]) - torch.tensor(first).index_select(0, slot)  # [N']
    xp = xs.new_zeros(slots * busiest, xs.shape[1]).index_copy_(0, dest, xs)  # [S*C, H]
    gate_up = torch.bmm(xp.view(slots, busiest, -1), w13.transpose(1, 2))  # [S, C, 2I]
    act = F.silu(gate_up.narrow(2, 0, inter)) * gate_up.narrow(2, inter, inter)  # [S, C, I]
    y = torch.bmm(act, w2.transpose(1, 2))  # [S, C, H]
    return y.view(slots * busiest, -1).index_select(0, dest)


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
