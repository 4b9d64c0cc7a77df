"""The EPLB planner's time model (coordinator/eplb/time_model.py): each server's layer priced as
a fixed part plus a time per token, fitted from the servers' compute times; checked against
numpy's least squares and, in a closed loop of plans and pushes with servers whose true times
are affine, against those true times."""

from __future__ import annotations

from concurrent.futures import Future

import numpy as np
import pytest
import torch

from coordinator.eplb.manager import EplbManager
from coordinator.eplb.plan import EplbConfig
from coordinator.eplb.time_model import MIN_SLOPE, fit_server_times
from coordinator.experts.load_recorder import LoadRecorder
from expertmesh import placement as pl


def samples(x: np.ndarray, y: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:  # one server: [W, 1, 1]
    return torch.tensor(y, dtype=torch.float64)[:, None, None], torch.tensor(x, dtype=torch.float64)[
        :, None, None
    ]


def test_the_fit_recovers_a_fixed_part_and_a_time_per_token_past_outliers():
    rng = np.random.default_rng(0)
    x = rng.integers(1, 200, 400).astype(np.float64)
    y = 0.3 + 0.002 * x + rng.normal(0, 0.01, x.size)
    slope, intercept = np.polyfit(x, y, 1)  # the reference, on the clean samples
    y_out = y.copy()
    y_out[::40] *= 20  # steps that waited on a commit: not the server's speed
    fit = fit_server_times(*samples(x, y_out))
    assert float(fit.base[0]) == pytest.approx(intercept, rel=0.05)
    assert 1.0 / float(fit.speed[0]) == pytest.approx(slope, rel=0.05)


@pytest.mark.parametrize(
    "x, y, base, per_token",
    [
        # too little spread in tokens for a slope: tokens over time
        ([10.0] * 20, [1.0, 1.2] * 10, 0.0, 22.0 / 200),
        # time falling with tokens: a token still costs a tenth of the mean time per token
        (list(range(1, 21)), [2.0 - 0.05 * i for i in range(1, 21)], None, None),
        # a negative fixed part: tokens over time
        (list(range(11, 31)), [-1.0 + 0.1 * i for i in range(11, 31)], 0.0, sum(-1.0 + 0.1 * i for i in range(11, 31)) / sum(range(11, 31))),
        # too few samples
        ([1.0, 5.0, 9.0], [1.0, 2.0, 3.0], 0.0, 6.0 / 15.0),
    ],
)  # fmt: skip
def test_the_fit_falls_back_where_a_line_would_mislead(x, y, base, per_token):
    fit = fit_server_times(*samples(np.array(x), np.array(y)))
    got_base, got_per_token = float(fit.base[0]), 1.0 / float(fit.speed[0])
    if base is None:  # the clamped slope, the line through the means
        mean_per_token = sum(y) / sum(x)
        assert got_per_token == pytest.approx(MIN_SLOPE * mean_per_token)
        assert got_base == pytest.approx(np.mean(y) - got_per_token * np.mean(x))
    else:
        assert (got_base, got_per_token) == (pytest.approx(base), pytest.approx(per_token))


def test_a_server_without_answers_is_not_measured():
    ms = torch.zeros(4, 2, 3, dtype=torch.float64)
    tokens = torch.zeros_like(ms)
    ms[:, 0], tokens[:, 0] = 1.0, 4.0
    fit = fit_server_times(ms, tokens)
    assert not fit.speed[0].isnan() and fit.speed[1].isnan() and fit.base[1].isnan()


# ---------------------------------------------------------------- closed loop

LAYERS, EXPERTS, TOP_K, WINDOW = [0, 1, 2], 16, 2, 24
# true ms per layer: a GPU server whose layer costs about the same for any tokens, a CPU server
# whose layer is mostly its fixed part (the bytes of the experts it touches) and slower per token
TRUE = {"gpu0": (0.20, 0.001), "cpu0": (0.30, 0.01)}


class Target:
    errors = (RuntimeError,)

    def __init__(self) -> None:
        self.live = pl.static_split(LAYERS, EXPERTS, ["gpu0"], ["cpu0"], 10)

    def live_placement(self) -> pl.Placement:
        return self.live

    def slot_capacity(self) -> torch.Tensor:
        return torch.tensor([10, 6])

    def default_speed(self) -> torch.Tensor:
        return torch.ones(2)

    def push(self, placement: pl.Placement, between_steps) -> list[str]:
        between_steps(lambda: setattr(self, "live", placement)).result()
        return []


def now(fn) -> Future:
    f: Future = Future()
    f.set_result(fn())
    return f


def true_times(p: pl.Placement, window: list[tuple[int, np.ndarray]]) -> float:
    """The planner's objective under the servers' true times: per layer, the slowest server's
    summed time over the window's steps, summed over layers."""
    per = {(layer, s): 0.0 for layer in LAYERS for s in range(len(p.servers))}
    for layer, ids in window:
        lp = p.layers[layer]
        for s, name in enumerate(p.servers):
            tok = int(np.isin(ids, [e for e, o in zip(lp.phy2log, lp.owner) if o == s]).sum())
            if tok:
                per[layer, s] += TRUE[name][0] + TRUE[name][1] * tok
    return sum(max(per[layer, s] for s in range(len(p.servers))) for layer in LAYERS)


def run_window(m: EplbManager, rec: LoadRecorder, live: pl.Placement, rng: np.random.Generator):
    """WINDOW steps of 16-32 tokens (experts by a skewed popularity, different per layer) with the
    servers' true times recorded, the manager told of each (its periodic plan runs after the
    last); returns the window's (layer, ids) in step order."""
    window = []
    for _ in range(WINDOW):
        t = int(rng.integers(16, 33))
        for layer in LAYERS:
            pop = np.roll(1.0 / np.arange(1, EXPERTS + 1) ** 1.2, 3 * layer + 12)
            ids = np.stack([rng.choice(EXPERTS, TOP_K, replace=False, p=pop / pop.sum()) for _ in range(t)])
            rec.record(layer, torch.tensor(ids))
            window.append((layer, ids))
            lp = live.layers[layer]
            for s in range(len(live.servers)):
                tok = int(np.isin(ids, [e for e, o in zip(lp.phy2log, lp.owner) if o == s]).sum())
                if tok:
                    name = live.servers[s]
                    rec.record_server_time(s, layer, TRUE[name][0] + TRUE[name][1] * tok, tok)
        m.on_step()
    m.wait_idle()
    return window


@pytest.mark.parametrize("model", ["affine", "proportional"])
def test_plans_predict_the_true_time_of_what_they_place_and_settle(model):
    """Each plan's predicted time of the placement it makes is checked against that placement's
    true time on the same load: within 5% for the affine model, whose plans also stop moving
    once balanced and never end slower than they began; the proportional model, priced at the
    live placement's load, mispredicts the placements it makes (the test tells them apart)."""
    rng = np.random.default_rng(1)
    target = Target()
    rec = LoadRecorder(LAYERS, EXPERTS, window_steps=WINDOW, num_servers=2)
    cfg = EplbConfig(interval_steps=WINDOW, window_steps=WINDOW, time_model=model, max_move_mb=0)
    m = EplbManager(cfg, rec, target, expert_bytes=1, between_steps=now)
    errors, before, skipped = [], [], []
    for _ in range(6):
        live = target.live
        window = run_window(m, rec, live, rng)
        plan = m.counters.history[-1].plan
        assert plan is not None, m.counters.history[-1].line()
        before.append(true_times(live, window))
        skipped.append(plan.skipped)
        if not plan.skipped:
            true_after = true_times(target.live, window)
            errors.append(abs(plan.time_after - true_after) / true_after)
    assert errors, "no plan moved anything"
    if model == "proportional":
        assert max(errors) > 0.2, errors
        return
    assert max(errors) < 0.05, errors
    assert skipped[-2:] == [True, True], (skipped, before)
    assert before[-1] < before[0], before


def test_each_plan_logs_how_it_priced_the_servers():
    rng = np.random.default_rng(2)
    target = Target()
    rec = LoadRecorder(LAYERS, EXPERTS, window_steps=WINDOW, num_servers=2)
    m = EplbManager(EplbConfig(interval_steps=WINDOW, window_steps=WINDOW), rec, target, 1, now)
    assert "not measured yet" in m.plan(force=True).summary()
    run_window(m, rec, target.live, rng)
    line = m.counters.history[-1].line()
    # the true times: gpu0 0.2 ms + 1 us a token, cpu0 0.3 ms + 10 us a token
    assert "gpu0 0.200 ms + 1.00 us/token" in line and "cpu0 0.300 ms + 10.00 us/token" in line, line
