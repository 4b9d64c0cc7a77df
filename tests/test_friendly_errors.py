"""What a user sees when something is wrong: a busy port is one line naming the port and its
flag (coordinator and both expert servers), a plaintext client meeting a TLS server is told to
pass --tls-ca, a bad flag value is one line naming the flag (before anything loads), the Python
client raises the library's typed errors, --help shows the defaults,
and ``expertmesh status`` keeps a down server's error out of the table."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from expertmesh import errors
from expertmesh.client import Client
from expertmesh.demo import write_demo_model
from expertmesh.status_cli import render
from expertmesh.tls import add_port

ROOT = Path(__file__).resolve().parent.parent
ENV = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "expertmesh.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=timeout)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_demo_model(tmp_path_factory.mktemp("demo") / "model")


@pytest.mark.slow
@pytest.mark.parametrize("command", ["coordinator", "cpu-server", "gpu-server"])
def test_a_busy_port_is_one_line_naming_it_and_its_flag(model, command):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        extra = ["--device", "cpu"] if command == "gpu-server" else []
        r = cli(command, "--model", str(model), "--port", str(port), *extra)
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    (line,) = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert f"127.0.0.1:{port}" in line and "--port" in line, line


@pytest.mark.slow
def test_a_busy_data_port_is_one_line_naming_it_and_its_flag(model):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = cli("cpu-server", "--model", str(model), "--port", "0", "--data-port", str(port))
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    (line,) = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert f"127.0.0.1:{port}" in line and "--data-port" in line, line


@pytest.mark.parametrize(
    "command, flag, value",
    [
        ("cpu-server", "--placement-spare-mb", "-5"),
        ("gpu-server", "--combine-wait-us", "-1"),
        ("coordinator", "--micro-batches", "0"),
    ],
)
def test_a_bad_flag_value_is_one_line_naming_the_flag(model, command, flag, value):
    extra = ["--device", "cpu"] if command == "gpu-server" else []
    r = cli(command, "--model", str(model), "--port", "0", flag, value, *extra, timeout=60)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    (line,) = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert flag in line and value in line, line


def test_a_plaintext_client_at_a_tls_server_is_told_to_pass_the_ca(tmp_path):
    from tests.tls_utils import CA

    cert = CA.make(tmp_path, "ca").issue(tmp_path, "server")
    server = grpc.server(futures.ThreadPoolExecutor(1))
    port = add_port(server, "127.0.0.1:0", cert)
    server.start()
    try:
        with Client(f"127.0.0.1:{port}", timeout=10) as c, pytest.raises(errors.Unavailable) as e:
            c.generate("x")
        assert "--tls-ca" in str(e.value)
        r = cli("generate", "--addr", f"127.0.0.1:{port}", "--prompt", "x", "--timeout", "10")
        assert r.returncode == 1 and "UNAVAILABLE" in r.stderr and "--tls-ca" in r.stderr, r.stderr
    finally:
        server.stop(0)


def test_the_client_raises_typed_errors_that_are_still_rpc_errors():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nobody listens there once closed
    with Client(f"127.0.0.1:{port}", timeout=5) as c, pytest.raises(errors.Unavailable) as e:
        c.generate(input_ids=[1])
    assert isinstance(e.value, grpc.RpcError) and e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "--tls-ca" not in str(e.value)  # refused, not closed: no TLS hint
    assert Client.generate.__doc__ and "max_new_tokens" in Client.generate.__doc__


def test_help_shows_the_defaults():
    for command, flags in (
        ("coordinator", ("--page-size", "--kv-memory", "--max-batch-tokens", "--dtype")),
        ("cpu-server", ("--dtype",)),
    ):
        r = cli(command, "--help", timeout=60)
        assert r.returncode == 0, r.stderr
        text = " ".join(r.stdout.split())
        for flag in flags:
            after = text.split(f"{flag} ", 2)[-1]  # the flag's entry in the options list
            assert "(default: " in after.split(" --")[0], (command, flag, after[:120])


def test_status_keeps_a_down_servers_error_out_of_the_table():
    long_error = "UNAVAILABLE: failed to connect to all addresses; last error: " + "x" * 300
    server = dict(
        kind="cpu", transport="grpc", link="-", slots_used=8, slot_capacity=8, layer_round_trip_ms=None
    )
    s = {
        "uptime_seconds": 5,
        "placement_generation": 1,
        "requests": {"running": 0, "waiting": 0, "finished": 0},
        "kv": {"pages_used": 0, "pages_total": 10, "page_size": 16, "pages_cached": 0},
        "throughput": dict(
            interval_seconds=1.0,
            generation_tokens_per_s=0,
            prompt_tokens_per_s=0,
            prompt_tokens_cached_per_s=0,
            requests_per_s=0,
            steps_per_s=0,
            linked_steps_per_s=0,
        ),
        "servers": [
            dict(server, name="cpu0", address="127.0.0.1:1", state="unavailable", last_error=long_error),
            dict(server, name="gpu0", address="127.0.0.1:2", state="ready", last_error=""),
        ],
        "hottest_experts": {},
    }
    lines = render("127.0.0.1:50051", s).splitlines()
    header = next(i for i, x in enumerate(lines) if x.startswith("SERVER"))
    row = lines[header + 1]
    assert row.split()[:3] == ["cpu0", "cpu", "unavailable"] and "UNAVAILABLE" not in row, row
    assert len(row) < 100, row
    (err,) = [x for x in lines if "failed to connect" in x]
    assert err.strip().startswith("cpu0:") and len(err) <= 130 and err.endswith("..."), err


def test_the_health_check_command_stays_light():
    """Container health checks run ``expertmesh health`` every few seconds under a 10 s timeout:
    it must not import torch (seconds of start-up on a loaded machine)."""
    code = (
        "import sys\nfrom expertmesh.cli import main\n"
        "rc = main(['health', '--addr', '127.0.0.1:1', '--timeout', '1'])\n"
        "print('torch' in sys.modules)"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=60
    )
    assert r.stdout.split()[-1] == "False", r.stdout + r.stderr
