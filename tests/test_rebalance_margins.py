"""bench_rebalance's trace of a stream that left the reference's greedy tokens: both tokens
scored on the same prefix, against a real coordinator serving the demo model."""

from __future__ import annotations

import asyncio
import re

import pytest

from benchmarks.bench_rebalance import margins
from expertmesh.client import Client
from expertmesh.demo import write_demo_model
from tests.fault_utils import start_coordinator


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory):
    co = start_coordinator(write_demo_model(tmp_path_factory.mktemp("demo") / "model"), "--dtype", "float32")
    yield co
    co.stop()


def test_a_changed_token_is_scored_below_the_greedy_one(coordinator) -> None:
    prompt = [5, 17, 42, 9, 33, 8]
    with Client(coordinator.addr) as c:
        greedy = c.generate(input_ids=prompt, max_new_tokens=6, temperature=0.0, ignore_eos=True).token_ids
    other = [*greedy[:3], (greedy[3] + 1) % 50 + 3, *greedy[4:]]
    ref = {(0, 0): greedy, (0, 1): greedy}
    got = {(0, 0): other, (0, 1): greedy}  # the second stream equal: not reported
    lines = asyncio.run(margins(coordinator.addr, [[prompt, prompt]], ref, [got]))
    assert len(lines) == 1, lines
    m = re.fullmatch(
        r"pass 1, stream \(0, 0\): token 3: run A's (\d+) log-prob (\S+), this run's (\d+) (\S+) \(gap (\S+)\)",
        lines[0],
    )
    assert m, lines[0]
    assert (int(m.group(1)), int(m.group(3))) == (greedy[3], other[3])
    a, b, gap = float(m.group(2)), float(m.group(4)), float(m.group(5))
    assert a <= 0 and b <= 0
    assert gap == pytest.approx(a - b, rel=0.01, abs=1e-5)  # printed to 3 digits
    assert gap > 0  # the greedy token is the most likely one on its own prefix
