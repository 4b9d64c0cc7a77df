"""MoE-LoRA maths shared by the coordinator and both expert servers (pure torch, no gRPC).

Per routed expert s and adapter a (scaling ``alpha / r`` or rsLoRA's ``alpha / sqrt(r)`` is
folded into every B when the adapter is loaded):

    gate_up = W13[s] x + B13[a, s] (A13[a, s] x)          # [2I]: rows 0..I-1 gate, I..2I-1 up
    h       = silu(gate_up[:I]) * gate_up[I:]             # the delta goes in BEFORE the activation
    y       = W2[s] h + B2[a, s] (A2[a, s] h)
    out[t]  = sum_k weights[t, k] * y_{slot_ids[t, k]}(x[t])

PEFT's per-expert adapters have separate A matrices for gate_proj and up_proj: they are stacked
into one A13 ``[r_gate + r_up, H]`` with a block-diagonal B13 ``[2I, r_gate + r_up]``; the fused
``target_parameters`` form has one A for gate_up (``[r, H]``) and B13 ``[2I, r]``. Both are the
same computation here. Ranks are zero-padded to the buffer's rank (a zero row/column adds
nothing).

Every token carries its adapter slot (``token_adapter [T]``, -1 = base model), so one batch mixes
adapters and base freely.

Shapes: T tokens, K top-k, H hidden, I expert intermediate, S expert slots, L adapter slots,
R13 / R2 the (padded) ranks of gate_up and down.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class ExpertLoRA:
    """One adapter's LoRA on the experts of one MoE layer (row s = expert or slot s)."""

    a13: torch.Tensor  # [S, R13, H]
    b13: torch.Tensor  # [S, 2I, R13], scaling folded in
    a2: torch.Tensor  # [S, R2, I]
    b2: torch.Tensor  # [S, H, R2], scaling folded in

    def __post_init__(self) -> None:
        s, r13, h = self.a13.shape
        s2, r2, inter = self.a2.shape
        assert s == s2 and tuple(self.b13.shape) == (s, 2 * inter, r13), (
            f"{self.a13.shape=} {self.b13.shape=}"
        )
        assert tuple(self.b2.shape) == (s, h, r2), f"{self.a2.shape=} {self.b2.shape=}"

    @property
    def ranks(self) -> tuple[int, int]:
        return self.a13.shape[1], self.a2.shape[1]

    def select(self, rows: list[int]) -> ExpertLoRA:
        """The LoRA of experts ``rows`` only (a server keeps the experts it holds)."""
        idx = torch.tensor(rows, dtype=torch.long)
        return ExpertLoRA(self.a13[idx], self.b13[idx], self.a2[idx], self.b2[idx])

    def padded(self, r13: int, r2: int) -> ExpertLoRA:
        """Zero-padded to ranks (r13, r2): the same delta."""
        c13, c2 = self.ranks
        assert r13 >= c13 and r2 >= c2, f"{self.ranks=} {r13=} {r2=}"
        return ExpertLoRA(
            F.pad(self.a13, (0, 0, 0, r13 - c13)),
            F.pad(self.b13, (0, r13 - c13)),
            F.pad(self.a2, (0, 0, 0, r2 - c2)),
            F.pad(self.b2, (0, r2 - c2)),
        )

    def to(self, device: torch.device | str, dtype: torch.dtype) -> ExpertLoRA:
        return ExpertLoRA(*(t.to(device=device, dtype=dtype) for t in (self.a13, self.b13, self.a2, self.b2)))


@dataclass(frozen=True)
class MoELoRAWeights:
    """The resident LoRA buffers of one MoE layer: L adapter slots x S expert slots, fixed ranks.

    A slot that holds no adapter (or an expert the adapter does not touch) is all zeros."""

    a13: torch.Tensor  # [L, S, R13, H]
    b13: torch.Tensor  # [L, S, 2I, R13]
    a2: torch.Tensor  # [L, S, R2, I]
    b2: torch.Tensor  # [L, S, H, R2]

    @staticmethod
    def zeros(
        num_adapters: int, num_slots: int, hidden: int, inter: int, r13: int, r2: int, dtype, device
    ) -> MoELoRAWeights:
        kw = {"dtype": dtype, "device": device}
        return MoELoRAWeights(
            torch.zeros(num_adapters, num_slots, r13, hidden, **kw),
            torch.zeros(num_adapters, num_slots, 2 * inter, r13, **kw),
            torch.zeros(num_adapters, num_slots, r2, inter, **kw),
            torch.zeros(num_adapters, num_slots, hidden, r2, **kw),
        )

    @staticmethod
    def stack(adapters: list[ExpertLoRA]) -> MoELoRAWeights:
        """Adapters (same experts, any ranks) stacked into slots 0..L-1 at their largest ranks."""
        r13 = max(a.ranks[0] for a in adapters)
        r2 = max(a.ranks[1] for a in adapters)
        padded = [a.padded(r13, r2) for a in adapters]
        return MoELoRAWeights(
            *(torch.stack([getattr(p, f) for p in padded]) for f in ("a13", "b13", "a2", "b2"))
        )

    @property
    def num_adapters(self) -> int:
        return self.a13.shape[0]

    @property
    def num_slots(self) -> int:
        return self.a13.shape[1]

    def put(self, index: int, lora: ExpertLoRA) -> None:
        """Writes one adapter into slot ``index`` (in place; ranks padded to the buffer's)."""
        r13, r2 = self.a13.shape[2], self.a2.shape[2]
        if lora.ranks[0] > r13 or lora.ranks[1] > r2:
            raise ValueError(f"adapter ranks {lora.ranks} exceed the buffer ranks ({r13}, {r2})")
        p = lora.padded(r13, r2)
        for name in ("a13", "b13", "a2", "b2"):
            getattr(self, name)[index].copy_(getattr(p, name))

    def clear(self, index: int) -> None:
        for name in ("a13", "b13", "a2", "b2"):
            getattr(self, name)[index].zero_()


@dataclass(frozen=True)
class LoRABatch:
    """What an expert backend needs to add LoRA to one forward: the layer's resident buffers and
    each token's buffer index (-1 = base)."""

    weights: MoELoRAWeights  # [L, S, ...]
    token_adapter: torch.Tensor  # [T] int, -1 = base


def lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """B (A x) for rows of x: x [n, in], a [R, in], b [out, R] -> [n, out], dtype of x."""
    return F.linear(F.linear(x, a), b)


def moe_lora_reference(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [S, 2I, H]
    w2: torch.Tensor,  # [S, H, I]
    slot_ids: torch.Tensor,  # [T, K] int, -1 = not here
    weights: torch.Tensor,  # [T, K] routing weights
    lora: MoELoRAWeights | None = None,
    token_adapter: torch.Tensor | None = None,  # [T] int, -1 = base
) -> torch.Tensor:  # [T, H], dtype of x
    """The batched MoE-LoRA computation in plain torch: the reference every kernel is checked
    against, and the CPU server's path. One GEMM per (slot) for the base weights, one LoRA
    shrink/expand pair per (slot, adapter) group of rows; summation order as ``torch_moe``."""
    out = torch.zeros_like(x)  # [T, H]
    if x.shape[0] == 0:
        return out
    inter = w2.shape[2]
    use_lora = lora is not None and token_adapter is not None and bool((token_adapter >= 0).any())
    for s in torch.unique(slot_ids[slot_ids >= 0]).tolist():
        kpos, tok = torch.where(slot_ids.t() == s)  # [n], [n]  (k-major: HF's row order)
        xs = x[tok]  # [n, H]
        gate_up = F.linear(xs, w13[s])  # [n, 2I]
        groups: list[tuple[int, torch.Tensor]] = []
        if use_lora:
            assert lora is not None and token_adapter is not None
            ad = token_adapter[tok]  # [n]
            groups = [(a, torch.where(ad == a)[0]) for a in torch.unique(ad[ad >= 0]).tolist()]
            for a, rows in groups:
                gate_up[rows] += lora_delta(xs[rows], lora.a13[a, s], lora.b13[a, s])
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]  # [n, I]
        y = F.linear(act, w2[s])  # [n, H]
        for a, rows in groups:
            assert lora is not None
            y[rows] += lora_delta(act[rows], lora.a2[a, s], lora.b2[a, s])
        # NOTE: weights are float32; the product rounds once to x's dtype
        y = y * weights[tok, kpos, None].float()
        out.index_add_(0, tok, y.to(out.dtype))
    return out
