"""Scaled rotary embeddings: inverse frequencies and scale factors, as HF transformers computes them.

Three quantities, all functions of the config alone (never of the batch):

* :func:`inv_freq` ``[D/2]``: the rotation speed of each dimension pair. ``linear`` divides every
  frequency by ``factor``; ``yarn`` keeps the fast (high-frequency) pairs as they were trained,
  divides the slow ones by ``factor`` and blends in between over the pairs whose wavelength falls
  between ``beta_fast`` and ``beta_slow`` rotations of ``original_max_position_embeddings``.
* :func:`attention_factor`: YaRN multiplies cos and sin by it (so q.k by its square); from
  ``mscale``/``mscale_all_dim`` when both are set, else ``0.1 ln(factor) + 1``.
* :func:`softmax_scale_factor`: DeepSeek's attention additionally multiplies the softmax scale by
  ``mscale(factor, mscale_all_dim)**2``.

The arithmetic follows HF's order (float32 tensors, the same divisions) so that float32 logits
agree to rounding. Shapes: D rotary dims.
"""

from __future__ import annotations

import math

import torch

from expertmesh.config import RopeScaling


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _default_inv_freq(dim: int, theta: float, device: torch.device | None) -> torch.Tensor:
    exps = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    return 1.0 / (theta**exps)  # [D/2]


def _yarn_inv_freq(dim: int, theta: float, s: RopeScaling, device: torch.device | None) -> torch.Tensor:
    def correction_dim(rotations: float) -> float:
        # the pair index whose wavelength fits `rotations` times into the original context
        return (dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
            2 * math.log(theta)
        )

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF: avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1).to(device)
    pos_freqs = theta ** (torch.arange(0, dim, 2, device=device).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (s.factor * pos_freqs)
    keep = 1 - ramp  # 1: extrapolate (trained speed), 0: interpolate (divided by factor)
    return interpolation * (1 - keep) + extrapolation * keep


def inv_freq(
    dim: int, theta: float, scaling: RopeScaling | None, device: torch.device | None = None
) -> torch.Tensor:
    """[D/2] float32 inverse frequencies."""
    if scaling is None:
        return _default_inv_freq(dim, theta, device)
    if scaling.rope_type == "linear":
        return _default_inv_freq(dim, theta, device) / scaling.factor
    assert scaling.rope_type == "yarn", scaling.rope_type
    return _yarn_inv_freq(dim, theta, scaling, device)


def attention_factor(scaling: RopeScaling | None) -> float:
    """The factor HF multiplies cos and sin by (1.0 but for YaRN)."""
    if scaling is None or scaling.rope_type != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    if scaling.mscale and scaling.mscale_all_dim:
        return _yarn_mscale(scaling.factor, scaling.mscale) / _yarn_mscale(
            scaling.factor, scaling.mscale_all_dim
        )
    return _yarn_mscale(scaling.factor)


def softmax_scale_factor(scaling: RopeScaling | None) -> float:
    """DeepSeek (V2, V3, Kimi-K2) attention: what HF multiplies ``q_head_dim**-0.5`` by."""
    if scaling is None or not scaling.mscale_all_dim:
        return 1.0
    m = _yarn_mscale(scaling.factor, scaling.mscale_all_dim)
    return m * m
