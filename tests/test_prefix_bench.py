"""benchmarks/bench_prefix_cache.py end to end on the CPU with a tiny published-config checkpoint,
in process and hybrid (the coordinator's own experts plus a real cpu-server process): the path
the device benchmark takes, so that its command does not first fail on the device. Speeds are
not checked (a smoke run); what the cache must do is: every reply the same with and without it,
prompts served from it only with it on, and the shared prefix's whole pages found."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_bench_inproc_and_hybrid(tmp_path) -> None:
    out = tmp_path / "res.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_prefix_cache.py"), "--real-width", "tiny",
           "--layers", "2", "--setups", "inproc", "local+cpu", "--parts", "shared", "chat",
           "--prefix", "40", "--suffix", "8", "--suffixes", "3", "--off-suffixes", "2",
           "--conversations", "2", "--turns", "2", "--system", "16", "--message", "8", "--reply", "3",
           "--repeat", "1", "--pages", "64", "--page-size", "4", "--threads", "1",
           "--ckpt-dir", str(tmp_path / "ckpt"), "--json", str(out)]  # fmt: skip
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert "| inproc |" in run.stdout and "| local+cpu |" in run.stdout  # the summary table
    res = json.loads(out.read_text())
    for setup in ("inproc", "local+cpu"):
        r = res["setups"][setup]
        assert r["chat_same_replies"] is True
        assert r["chat"]["no_cache"]["cached_tokens"] == 0
        # turn 2 of each conversation starts with turn 1's prompt and reply: its whole pages
        assert r["chat"]["cache"]["cached_tokens"] > 0
        assert r["shared"]["cache"]["repeat_cached"] == 40  # the prefix's 10 whole pages of 4
        assert r["shared"]["no_cache"]["repeat_cached"] == 0
        assert r["shared"]["no_cache"]["requests"] == 2 and r["shared"]["cache"]["requests"] == 3
