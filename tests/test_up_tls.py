"""``expertmesh up --tls-cert/--tls-key/--tls-ca``: every hop of the three-process
cluster is TLS. A TLS client gets the in-process engine's greedy tokens; a plaintext client is
refused; both expert servers serve TLS and require a client certificate from the CA (the
coordinator's, which they accept); a CA without a certificate is refused at once."""

from __future__ import annotations

import re
import signal
import subprocess
import sys

import grpc
import pytest

from coordinator.model.engine import Engine
from expertmesh import health
from expertmesh.client import Client
from expertmesh.tls import TLSConfig
from tests.test_cli import ENV, ROOT, model, server_ports, start_up  # noqa: F401 (fixture)
from tests.test_cluster_faults import run_steps


def _ca(tmp_path, name):
    # NOTE: imported here: `cryptography` is a test dependency the lent GPU machine lacks, and its
    # `pytest -m gpu` run still collects this module (as tests/test_tls.py does)
    from tests.tls_utils import CA

    return CA.make(tmp_path, name)


PROMPT = [5, 6, 7]
STEPS = 5


def test_up_with_tls_serves_tls_clients_only(model, tmp_path):  # noqa: F811
    ca = _ca(tmp_path, "upca")
    tls = ca.issue(tmp_path, "cluster")  # server and client authentication, 127.0.0.1
    assert tls.cert and tls.key and tls.ca
    flags = ["--tls-cert", tls.cert, "--tls-key", tls.key, "--tls-ca", tls.ca]
    up = start_up("--model", str(model), "--device", "cpu", "--threads", "1", "--http-port", "-1", *flags)
    try:
        assert up.stdout is not None and up.stderr is not None
        line = up.stdout.readline()  # blocks until serving (or exit)
        m = re.search(r"expertmesh is serving on (\S+):(\d+)", line)
        assert m, f"no address line: {line!r}; stderr:\n{up.stderr.read() if up.poll() is not None else ''}"
        addr = f"{m.group(1)}:{m.group(2)}"
        servers = [f"127.0.0.1:{p}" for p in server_ports(up.stderr)]
        assert len(servers) == 2, servers

        eng = Engine.from_checkpoint(str(model))
        ref = [int(x.argmax()) for x in run_steps(eng, PROMPT, STEPS)]
        with Client(addr, timeout=60, tls=TLSConfig(ca=tls.ca)) as c:
            out = c.generate(input_ids=PROMPT, max_new_tokens=STEPS, ignore_eos=True)
        assert out.token_ids == ref
        with pytest.raises(grpc.RpcError) as ei, Client(addr, timeout=10) as c:
            c.generate(input_ids=PROMPT, max_new_tokens=1)
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE

        for s in servers:  # mutual TLS on the expert servers
            assert health.check(s, 5.0, tls=tls) == "SERVING"
            assert health.check(s, 5.0, tls=TLSConfig(ca=tls.ca)) == "UNREACHABLE"  # no client cert
            assert health.check(s, 2.0) == "UNREACHABLE"  # plaintext
    finally:
        up.send_signal(signal.SIGTERM)
        rc = up.wait(60)
    assert rc == 0


def test_up_refuses_a_ca_without_a_certificate(model, tmp_path):  # noqa: F811
    ca = _ca(tmp_path, "upca2")
    cmd = ["-m", "expertmesh.cli", "up", "--model", str(model), "--tls-ca", str(ca.path)]
    r = subprocess.run([sys.executable, *cmd], capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=60)
    assert r.returncode == 2 and "--tls-cert and --tls-key" in r.stderr, r.stderr
