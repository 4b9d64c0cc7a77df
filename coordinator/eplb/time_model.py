"""Each expert server's time per MoE layer as a function of the tokens it computes there,
fitted from the servers' own compute times over the load window: ``ms = base + tokens / speed``.

Why not tokens over speed alone (``base`` = 0, the proportional model): a server's layer has a
part that does not grow with its tokens. A GPU server's launches and waits cost about the same
for 10 tokens as for 100; a CPU server's decode layer is bound by the bytes of the experts it
touches, nearly all it holds once a few sequences run, so its time moves little with tokens.
Priced as tokens per ms measured at one load, a server that was given fewer tokens looks slower
the next window (its fixed part divided by fewer tokens), the plan moves tokens off it again,
and the plans swing: at full size (Qwen3-30B-A3B, a GPU and a CPU server, benchmarks/RESULTS.md)
consecutive plans predicted 24-86% gains that the steps did not show, the token balance
alternating between two placements, and the steady state ended slower than the static split.

The fit is ordinary least squares over the window's (layer, step) samples in which a server
computed tokens (layers route different token counts to a server, so the tokens vary even at a
fixed batch), refitted once without the samples far above the line (a step that waited on a
placement commit or a page fault is not the server's speed). Guards, since a plan extrapolates:
a token is never priced below a tenth of the server's mean time per token (``MIN_SLOPE``), and a
fit with a negative fixed part, too few samples or too little spread in tokens falls back to the
proportional model of those samples.

Shapes: W window steps, S servers, L MoE layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MIN_SAMPLES = 8
MIN_SLOPE = 0.1  # of the mean ms per token
MIN_SPREAD = 1.5  # the largest sample's tokens over the smallest's, for a slope to mean anything
OUTLIER_MADS = 5.0


@dataclass(frozen=True)
class ServerTimes:
    speed: torch.Tensor  # [S] float64 tokens per ms (1 / the time per token); NaN: not measured
    base: torch.Tensor  # [S] float64 ms per layer that does not grow with tokens; NaN: not measured


def fit_server_times(ms: torch.Tensor, tokens: torch.Tensor) -> ServerTimes:  # ms, tokens [W, S, L]
    s = ms.shape[1]
    speed = torch.full((s,), float("nan"), dtype=torch.float64)
    base = torch.full((s,), float("nan"), dtype=torch.float64)
    for k in range(s):
        x, y = tokens[:, k].reshape(-1).double(), ms[:, k].reshape(-1).double()
        keep = (x > 0) & (y > 0)
        x, y = x[keep], y[keep]
        if x.numel() == 0:
            continue
        a, b = _fit(x, y)
        speed[k], base[k] = 1.0 / b, a
    return ServerTimes(speed, base)


def _fit(x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:  # base ms, ms per token
    per_token = float(y.sum() / x.sum())
    if x.numel() < MIN_SAMPLES or float(x.max()) < MIN_SPREAD * float(x.min()):
        return 0.0, per_token
    a, b = _ols(x, y)
    resid = y - (a + b * x)
    mad = float((resid - resid.median()).abs().median())
    # NOTE: far above the line in MADs and by a tenth of the mean time (on a near-exact line
    # the MAD is rounding, and a cut in MADs alone would drop good samples)
    inlier = resid <= resid.median() + max(OUTLIER_MADS * mad, 0.1 * float(y.mean()))
    kept = int(inlier.sum())
    if MIN_SAMPLES <= kept < x.numel() and float(x[inlier].max()) >= MIN_SPREAD * float(x[inlier].min()):
        x, y = x[inlier], y[inlier]
        per_token = float(y.sum() / x.sum())
        a, b = _ols(x, y)
    b = max(b, MIN_SLOPE * per_token)
    a = float(y.mean()) - b * float(x.mean())
    if a < 0:
        return 0.0, per_token
    return a, b


def _ols(x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    xm, ym = x.mean(), y.mean()
    var = float(((x - xm) ** 2).sum())
    b = float(((x - xm) * (y - ym)).sum()) / var if var > 0 else 0.0
    return float(ym) - b * float(xm), b
