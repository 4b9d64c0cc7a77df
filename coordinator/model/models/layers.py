"""Building blocks shared by the model zoo: norms, rotary embeddings, merged linears, MLPs.

Shapes: T tokens in the step, H hidden, D head dim, I intermediate.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from coordinator.model.models import rope
from expertmesh.config import RopeScaling


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and x.stride(-1) == 1:
            from coordinator.model.kernels.fused_ops import rmsnorm

            return rmsnorm(x.reshape(-1, x.shape[-1]), self.weight, self.eps)[1].view(x.shape)
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of ``x [..., D]``, ``weight`` broadcast against it (``[D]``, or
    ``[heads, D]`` for per-head weights of a ``[T, heads, D]`` input)."""
    if x.dtype == torch.float32:
        # one call instead of six from Python; in float32 torch's norm gives HF's numbers bit for
        # bit (there is no cast in between to round; tests/test_cpu_step.py checks it)
        if weight.dim() == 1:
            return F.rms_norm(x, (x.shape[-1],), weight, eps)
        return F.rms_norm(x, (x.shape[-1],), None, eps) * weight
    # NOTE: normalise in float32, cast back, then scale: the order HF uses, so bf16 rounds alike.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class MergedLinear(nn.Module):
    """Several checkpoint linears sharing one input, stored as one [sum(out), in] weight.

    ``parts`` maps each checkpoint name (``q_proj``) to its row count; the loader fills
    the rows in order.
    """

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.parts = dict(parts)
        out = sum(parts.values())
        self.weight = nn.Parameter(torch.empty(out, in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out, dtype=dtype)) if bias else None

    def part_rows(self, name: str) -> tuple[int, int]:
        start = 0
        for n, rows in self.parts.items():
            if n == name:
                return start, rows
            start += rows
        raise KeyError(name)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        y = F.linear(x, self.weight, self.bias)
        return list(y.split(list(self.parts.values()), dim=-1))


def linear(in_f: int, out_f: int, dtype: torch.dtype, bias: bool = False) -> nn.Linear:
    return nn.Linear(in_f, out_f, bias=bias, dtype=dtype)


class GatedMLP(nn.Module):
    """SiLU-gated MLP (dense layers and shared experts), gate/up merged."""

    def __init__(self, hidden: int, inter: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden, {"gate_proj": inter, "up_proj": inter}, False, dtype)
        self.down_proj = linear(inter, hidden, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x)
        return self.down_proj(F.silu(gate) * up)


class Rotary(nn.Module):
    """Rotary position embedding, half-split or interleaved pairs; plain or scaled (``scaling``:
    linear / YaRN frequencies and YaRN's cos/sin factor, see rope.py)."""

    def __init__(
        self, dim: int, theta: float, interleave: bool = False, scaling: RopeScaling | None = None
    ) -> None:
        super().__init__()
        # NOTE: not a buffer: models are built on the meta device, and this costs nothing to redo
        self.dim, self.theta, self.interleave, self.scaling = dim, theta, interleave, scaling
        self.factor = rope.attention_factor(scaling)

    def inv_freq(self, device: torch.device) -> torch.Tensor:  # [D/2] float32, scaled if configured
        return rope.inv_freq(self.dim, self.theta, self.scaling, device)

    def rolled_tables(
        self, positions: torch.Tensor, dtype: torch.dtype, memo: dict[object, object] | None
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [T, 1, D] each: cos, and sin negated on the first half
        """The tables :meth:`apply_rolled` takes. ``memo``: the step's (ForwardBatch.memo): the
        first layer computes them, the others reuse them (every layer's rotary is the same
        function of the step's positions)."""
        key = ("rotary", self.dim, self.theta, self.scaling, dtype, positions.data_ptr(), positions.shape)
        got = memo.get(key) if memo is not None else None
        if got is None:
            cos, sin = self.cos_sin(positions, dtype)
            half = self.dim // 2
            got = (cos[:, None, :], torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)[:, None, :])
            if memo is not None:
                memo[key] = got
        return got  # type: ignore[return-value]

    def apply_rolled(self, x: torch.Tensor, cos: torch.Tensor, sin_neg: torch.Tensor) -> torch.Tensor:
        """:meth:`apply` of half-split pairs in fewer ops, the same numbers: x [T, heads, D],
        tables from :meth:`rolled_tables`. The halves swapped (a roll) times the sin whose first
        half is negated is the same product as ``cat(-x2, x1) * sin`` (a sign flip is exact)."""
        assert not self.interleave, "interleaved pairs take apply()"
        return x * cos + x.roll(self.dim // 2, -1) * sin_neg

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [T, D]
        inv_freq = self.inv_freq(positions.device)  # [D/2]
        freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [T, D]
        if self.factor != 1.0:  # YaRN scales cos/sin in float32, before the cast (as HF)
            return (emb.cos() * self.factor).to(dtype), (emb.sin() * self.factor).to(dtype)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """x: [T, heads, D]; cos/sin: [T, D]."""
        if self.interleave:
            # pairs (0,1),(2,3).. -> halves, as DeepSeek's checkpoints lay the rope dims out
            t, h, d = x.shape
            x = x.view(t, h, d // 2, 2).transpose(-1, -2).reshape(t, h, d)
        cos, sin = cos[:, None, :], sin[:, None, :]
        half = x.shape[-1] // 2
        rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rot * sin
