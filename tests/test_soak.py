"""The soak benchmark, small: 200 requests at concurrency 8 and 32 with random
cancellations and deadlines against a coordinator + CPU expert server (real processes): no
error but the cancelled/deadlined, greedy answers equal to one-at-a-time, every KV page free,
no growth of fds, threads, RSS or /dev/shm in any process (benchmarks/soak.py checks them)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def test_soak_small(tmp_path):
    out = tmp_path / "soak.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--requests", "200", "--servers", "cpu",
           "--concurrency", "8", "32", "--phase", "50", "--max-new-tokens", "8", "--greedy-tokens", "6",
           "--cancel", "0.15", "--deadline", "0.1", "--json", str(out)]  # fmt: skip
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    r = json.loads(out.read_text())
    t = r["tally"]
    assert r["failures"] == [] and t["errors"] == {} and t["mismatches"] == 0
    assert t["ok"] + t["cancelled"] + t["deadline"] == 200 and t["ok"] > 100 and t["cancelled"] > 0
    assert r["kv_pages_used"] == 0 and r["greedy_after_equal"]
    assert set(r["end"]) == {"coordinator", "cpu-server"}
