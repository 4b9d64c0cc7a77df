"""The kernel compile helper's decisions and its process's life (coordinator/model/compile_ahead.py);
that it leaves the coordinator nothing to compile is a GPU test (test_compile_ahead_gpu.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from coordinator.model import compile_ahead
from expertmesh.config import ModelConfig, cut_layers
from tests.hf_models import BASE, CONFIGS

SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie that nobody reaped yet does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize(
    ("argv", "want"),
    [
        (["--model", "m", "--device", "cuda"], True),
        (["--model", "m", "--device=cuda:1", "--dtype", "bfloat16"], True),
        (["--model", "m"], False),  # the default device: the CPU
        (["--model", "m", "--device", "cpu"], False),
        (["--model", "m", "--device", "cuda", "--no-compile-ahead"], False),
        (["--model", "m", "--device", "cuda", "--help"], False),
        (["--model", "m", "--device", "cuda", "--cpu-server", "127.0.0.1:1"], False),
        (["--model", "m", "--device", "cuda", "--gpu-server", "127.0.0.1:1"], False),
        (["--model", "m", "--device", "cuda", "--placement", "p.json"], False),
        (["--model", "m", "--device"], False),  # malformed: left to the real parser
    ],
)
def test_the_helper_starts_for_a_cuda_coordinator_with_every_expert_in_process(argv, want) -> None:
    assert compile_ahead.wanted(argv) is want


def test_the_coordinator_parser_takes_the_flag() -> None:
    import argparse

    from coordinator.main import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert p.parse_args(["--model", "m", "--no-compile-ahead"]).no_compile_ahead
    assert not p.parse_args(["--model", "m"]).no_compile_ahead
    # wanted() reads --device without the coordinator's parser (which imports torch): the same default
    assert p.parse_args(["--model", "m"]).device == "cpu"


def test_a_long_wait_says_so_in_the_log(sleeper, monkeypatch, caplog) -> None:
    monkeypatch.setattr(compile_ahead, "WAIT_NOTICE_S", 0.2)
    compile_ahead.start(["--model", "m", "--device", "cuda"])
    with caplog.at_level("INFO", logger="expertmesh.coordinator"):
        compile_ahead.wait_for(64, limit_s=1.0)
    waiting = [r.getMessage() for r in caplog.records if "waiting" in r.getMessage()]
    assert waiting and "bucket 64" in waiting[0], caplog.text
    assert any("stopped, compiling here" in r.getMessage() for r in caplog.records)
    assert compile_ahead._helper is None


@pytest.mark.parametrize("n", [1, 2, 15, 16, 17, 31, 32, 64, 65, 80, 1000, 4096, 123457])
def test_cut_pages_keeps_what_triton_specialises(n) -> None:
    m = compile_ahead.cut_pages(n)
    assert 1 <= m <= 64 + 15 and m <= n
    assert m % 16 == n % 16
    assert (m == 1) == (n == 1)


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_cut_layers_keeps_one_layer_of_each_kind(arch) -> None:
    raw = {"model_type": arch, **BASE, **CONFIGS[arch]}
    cfg = ModelConfig.from_dict(raw)
    cut = cut_layers(cfg)
    kinds = set(cfg.moe_layers)
    assert set(cut.moe_layers) == kinds
    assert cut.moe_layers == cfg.moe_layers[: cut.num_layers]
    # nothing shorter keeps both kinds
    assert set(cfg.moe_layers[: cut.num_layers - 1]) != kinds
    assert cut.num_layers == {"mixtral": 1, "olmoe": 1, "qwen2_moe": 1}.get(arch, 2)
    # the rest of the model as it was
    assert (cut.hidden_size, cut.num_experts, cut.vocab_size) == (
        cfg.hidden_size,
        cfg.num_experts,
        cfg.vocab_size,
    )


@pytest.fixture
def sleeper(monkeypatch):
    monkeypatch.setattr(compile_ahead, "command", lambda argv: SLEEPER)
    yield
    compile_ahead.stop()


def test_stop_ends_a_running_helper(sleeper) -> None:
    compile_ahead.start(["--model", "m", "--device", "cuda"])
    helper = compile_ahead._helper
    assert helper is not None and compile_ahead.running()
    compile_ahead.stop()
    assert helper.poll() is not None and not compile_ahead.running()
    assert compile_ahead.wait() == 0.0  # nothing left to wait for


def test_a_wait_that_runs_out_stops_the_helper(sleeper) -> None:
    compile_ahead.start(["--model", "m", "--device", "cuda"])
    helper = compile_ahead._helper
    assert helper is not None
    t0 = time.monotonic()
    compile_ahead.wait(limit_s=0.5)
    assert time.monotonic() - t0 < 15
    assert helper.poll() is not None


def fake_helper(monkeypatch, script: str) -> None:
    monkeypatch.setattr(
        compile_ahead, "command", lambda argv: [sys.executable, "-c", textwrap.dedent(script)]
    )


def test_the_warm_up_takes_each_bucket_once_the_helper_compiled_it(monkeypatch) -> None:
    fake_helper(
        monkeypatch,
        """
        import sys, time
        print(64, flush=True)
        time.sleep(1.0)
        sys.stdout.write("32\\n16\\n8")  # two lines and the start of a third at once
        sys.stdout.flush()
        time.sleep(1.0)
        print(flush=True)
        time.sleep(1.0)
        """,
    )
    try:
        compile_ahead.start(["--model", "m", "--device", "cuda"])
        t0 = time.monotonic()
        compile_ahead.wait_for(64)
        assert time.monotonic() - t0 < 0.9
        compile_ahead.wait_for(32)
        t32 = time.monotonic() - t0
        assert t32 >= 0.9
        compile_ahead.wait_for(16)  # NOTE: read with 32: no wait for another line
        assert time.monotonic() - t0 - t32 < 0.5
        compile_ahead.wait_for(8)  # its line ends a second later
        assert time.monotonic() - t0 >= 1.9
        assert compile_ahead.running()
        compile_ahead.wait_for(4)  # never printed: returns when the helper ends
        assert time.monotonic() - t0 >= 2.9
        assert not compile_ahead.running() and compile_ahead._helper is None
        compile_ahead.wait_for(2)
    finally:
        compile_ahead.stop()


def test_a_bucket_the_helper_never_reports_stops_it_at_the_limit(sleeper) -> None:
    compile_ahead.start(["--model", "m", "--device", "cuda"])
    helper = compile_ahead._helper
    assert helper is not None
    t0 = time.monotonic()
    compile_ahead.wait_for(64, limit_s=0.5)
    assert 0.5 <= time.monotonic() - t0 < 15
    assert helper.poll() is not None and compile_ahead._helper is None


def test_no_helper_for_a_cpu_coordinator(sleeper) -> None:
    compile_ahead.start(["--model", "m", "--device", "cpu"])
    assert compile_ahead._helper is None and compile_ahead.wait() == 0.0


def test_the_helper_dies_with_its_coordinator(tmp_path) -> None:
    """A coordinator killed outright (no stop()) takes its helper with it."""
    script = textwrap.dedent(
        f"""
        import sys, time
        from coordinator.model import compile_ahead
        compile_ahead.command = lambda argv: {SLEEPER!r}
        compile_ahead.start(["--model", "m", "--device", "cuda"])
        print(compile_ahead._helper.pid, flush=True)
        time.sleep(120)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert pid_alive(child)
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 10
        while pid_alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not pid_alive(child), "the helper outlived its coordinator"
    finally:
        parent.kill()
        parent.wait(10)


def test_a_helper_that_fails_says_why(tmp_path) -> None:
    """Without CUDA (none visible, on any machine) the helper's own parse of the coordinator's
    arguments fails: it says why and exits 1 (the coordinator's wait then logs it and compiles
    what is missing itself)."""
    out = subprocess.run(
        compile_ahead.command(["--model", str(tmp_path), "--device", "cuda"]),
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, CUDA_VISIBLE_DEVICES=""),
    )
    assert out.returncode == 1
    assert "kernel compile helper failed" in out.stderr and "CUDA is not available" in out.stderr
