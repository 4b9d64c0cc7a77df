"""The kernel compile helper on a GPU (coordinator/model/compile_ahead.py): what it compiles is every
kernel the CUDA coordinator's start asks for, so the coordinator compiles nothing itself."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from coordinator.model import compile_ahead
from expertmesh.demo import write_demo_model
from tests.cluster_utils import ROOT
from tests.fault_utils import start_coordinator, wait_health

pytestmark = pytest.mark.gpu


def cached(d: Path) -> set[str]:
    """Triton's cache: one directory per compiled kernel or built launcher."""
    return {str(p.relative_to(d)) for p in d.rglob("*") if p.is_file() and not p.name.startswith("tmp")}


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Path:
    return write_demo_model(tmp_path_factory.mktemp("demo") / "model")


def test_the_helper_leaves_the_coordinator_nothing_to_compile(demo, tmp_path, monkeypatch) -> None:
    cache = tmp_path / "triton"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    args = ["--model", str(demo), "--device", "cuda", "--dtype", "bfloat16"]
    out = subprocess.run(compile_ahead.command(args), capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "the decode buckets' kernels ready" in out.stderr, out.stderr
    compiled = cached(cache)
    assert any(name.endswith(".cubin") for name in compiled), sorted(compiled)
    # the coordinator alone (no helper), on the helper's cache: its warm-up and capture find
    # every kernel there
    co = start_coordinator(demo, "--device", "cuda", "--dtype", "bfloat16", "--no-compile-ahead", timeout=600)
    try:
        wait_health(co.addr, "SERVING", timeout=120)
    finally:
        co.stop()
    assert "kernel compile helper" not in co.output()
    assert cached(cache) == compiled, sorted(cached(cache) - compiled)


def test_the_coordinator_starts_its_helper_and_waits_for_it(demo, tmp_path, monkeypatch) -> None:
    cache = tmp_path / "triton"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    co = start_coordinator(demo, "--device", "cuda", "--dtype", "bfloat16", timeout=600)
    try:
        wait_health(co.addr, "SERVING", timeout=120)
        text = co.output()
        assert "the decode buckets' kernels ready" in text, text
        m = re.search(r"kernel compile helper \(pid (\d+)\) ended", text)
        assert m, text
        assert not Path(f"/proc/{m.group(1)}").exists()  # ended and reaped
    finally:
        co.stop()
    assert any(name.endswith(".cubin") for name in cached(cache))
