"""The coordinator's slow-step log line: a decode step far above the recent median is logged
with the expert servers it waited on (their layer round trips in that step); prefills, the first
steps and steps near the median are not, and lines are rate-limited."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import pytest

from coordinator.serving import metrics as m


def fresh() -> m.CoordinatorMetrics:
    coord = SimpleNamespace(
        scheduler=SimpleNamespace(), eplb=None, lora=SimpleNamespace(), dispatcher=SimpleNamespace()
    )
    return m.CoordinatorMetrics(coord)


def step(cm: m.CoordinatorMetrics, seconds: float, decode: bool = True, trips: dict | None = None) -> None:
    for server, each in (trips or {}).items():
        for s in each:
            cm.round_trip(server, s)
    cm.step_time(time.perf_counter() - seconds, decode=decode)


def slow_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "slow decode step" in r.getMessage()]


def test_a_slow_decode_step_says_which_server_it_waited_on(caplog, monkeypatch):
    monkeypatch.setattr(m, "SLOW_STEP_LOG_S", 0.0)
    cm = fresh()
    with caplog.at_level(logging.WARNING, logger="expertmesh.coordinator"):
        step(cm, 0.3)  # among the first steps: no median yet
        for _ in range(40):
            step(cm, 0.02, trips={"gpu0": [0.0004] * 4, "cpu0": [0.0005] * 4})
        step(cm, 0.5, decode=False)  # a prefill: slow by nature
        step(cm, 0.06)  # 3x the median: not slow
        assert slow_lines(caplog) == []
        step(cm, 0.4, trips={"gpu0": [0.001] * 3, "cpu0": [0.3, 0.001, 0.002]})
    (line,) = slow_lines(caplog)
    assert "400." in line and "no placement move" in line
    # the server that held the step comes first, with its longest layer
    assert line.index("cpu0 303.0 ms over 3 layers (longest 300.0)") < line.index("gpu0 3.0 ms")


def test_slow_step_lines_are_rate_limited(caplog):
    cm = fresh()
    with caplog.at_level(logging.WARNING, logger="expertmesh.coordinator"):
        for _ in range(40):
            step(cm, 0.02)
        step(cm, 0.3)
        step(cm, 0.3)  # within SLOW_STEP_LOG_S of the first
    assert len(slow_lines(caplog)) == 1
    assert "none (a linked step, or no expert server)" in slow_lines(caplog)[0]
