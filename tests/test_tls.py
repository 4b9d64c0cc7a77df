"""TLS on every gRPC hop, with certificates made in the test: a cluster (coordinator in this
process + a CPU expert server subprocess) with mutual TLS between them, the cluster token and
the admin token serves requests (HF's greedy tokens) to TLS clients and the admin CLI; plaintext
clients are refused by both servers; an expert server refuses a client certificate from another
CA, and a TLS client without one."""

from __future__ import annotations

import ssl
import time

import grpc
import httpx
import pytest

from coordinator.experts.remote import ClusterConfig, ServerSpec
from coordinator.serving.server import CoordinatorConfig
from expertmesh import auth, health
from expertmesh.cli import main as cli
from expertmesh.client import Client
from expertmesh.tls import TLSConfig, TLSError, channel
from expertmesh.v1 import admin_pb2, admin_pb2_grpc
from expertmesh.v1 import expert_worker_pb2 as pb
from expertmesh.v1 import expert_worker_pb2_grpc as pb_grpc
from tests.cluster_utils import start_server
from tests.hf_models import make_checkpoint
from tests.serving_utils import (
    ServerThread,
    hf_greedy,
    one_thread,  # noqa: F401 (autouse fixture)
)

pytestmark = pytest.mark.slow
PROMPT = [5, 17, 33, 2, 9]
STEPS = 6


@pytest.fixture(scope="module")
def tls_cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("tls")
    hf = make_checkpoint("qwen3_moe", root / "model")
    ref, _ = hf_greedy(hf, PROMPT, STEPS)
    # NOTE: imported here: `cryptography` is a test dependency the lent GPU machine lacks, and its
    # `pytest -m gpu` run still collects this module
    from tests.tls_utils import CA

    ca, rogue = CA.make(root, "good"), CA.make(root, "rogue")
    certs = {
        "expert": ca.issue(root, "expert", client=False),
        "coordinator": ca.issue(root, "coordinator"),  # its server cert and its client cert
        "rogue": rogue.issue(root, "intruder", server=False),
    }
    e = certs["expert"]
    server = start_server(
        "cpu", root / "model", 0, "--tls-cert", str(e.cert), "--tls-key", str(e.key), "--tls-ca", str(e.ca),
        "--cluster-token", "clu5ter",
    )  # fmt: skip
    config = CoordinatorConfig(
        model_dir=str(root / "model"),
        port=0,
        http_port=0,
        page_size=4,
        connect_timeout_s=5.0,
        cluster=ClusterConfig(
            (ServerSpec("cpu0", server.address, "cpu"),),
            timeout_s=20.0,
            cluster_token="clu5ter",
            tls=certs["coordinator"],
        ),
        admin_token="adm1n",
        tls=certs["coordinator"],
    )
    try:
        with ServerThread(config) as s:
            client_tls = TLSConfig(ca=str(ca.path))
            health_ok = False
            for _ in range(600):
                if health.check(s.addr, 1.0, tls=client_tls) == "SERVING":
                    health_ok = True
                    break
                time.sleep(0.1)
            assert health_ok, "the TLS cluster never turned SERVING"
            yield s, server, ca, certs, ref
    finally:
        server.stop()


def test_a_tls_cluster_serves_tls_clients(tls_cluster):
    s, _, ca, _, ref = tls_cluster
    with Client(s.addr, timeout=60, tls=TLSConfig(ca=str(ca.path))) as c:
        out = c.generate(input_ids=PROMPT, max_new_tokens=STEPS, ignore_eos=True)
    assert out.token_ids == ref
    # the shared-memory fast path was set up through the TLS stream (same host)
    with channel(s.addr, TLSConfig(ca=str(ca.path))) as ch:
        listed = admin_pb2_grpc.AdminStub(ch).ListServers(
            admin_pb2.ListServersRequest(), metadata=auth.metadata("adm1n"), timeout=10
        )
    assert [(x.name, x.state, x.transport) for x in listed.servers] == [("cpu0", "ready", "shm")]
    # the server name checked is the one asked for (the certificate says localhost and 127.0.0.1)
    with Client(s.addr, timeout=60, tls=TLSConfig(ca=str(ca.path), server_name="localhost")) as c:
        assert c.generate(input_ids=PROMPT, max_new_tokens=STEPS, ignore_eos=True).token_ids == ref
    wrong_name = TLSConfig(ca=str(ca.path), server_name="elsewhere.example")
    with pytest.raises(grpc.RpcError) as ei, Client(s.addr, timeout=10, tls=wrong_name) as c:
        c.generate(input_ids=PROMPT, max_new_tokens=1)
    assert ei.value.code() == grpc.StatusCode.UNAVAILABLE


def test_the_admin_cli_talks_tls_with_the_token(tls_cluster, capsys, monkeypatch):
    s, _, ca, _, _ = tls_cluster
    base = ["--addr", s.addr, "--tls-ca", str(ca.path)]
    assert cli(["placement", "show", *base, "--admin-token", "adm1n"]) == 0
    assert '"cpu0"' in capsys.readouterr().out
    monkeypatch.setenv(auth.ADMIN_TOKEN_ENV, "adm1n")  # the environment variable works the same
    assert cli(["load", *base]) == 0
    assert "window: last" in capsys.readouterr().out
    monkeypatch.delenv(auth.ADMIN_TOKEN_ENV)
    assert cli(["load", *base]) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    assert cli(["load", "--addr", s.addr, "--admin-token", "adm1n"]) == 1  # plaintext: refused
    assert "UNAVAILABLE" in capsys.readouterr().err


def test_the_http_api_serves_https_with_the_same_certificate(tls_cluster):
    s, _, ca, _, _ = tls_cluster
    port = s.server.http.port
    trust = ssl.create_default_context(cafile=str(ca.path))
    with httpx.Client(verify=trust, timeout=30) as http:
        assert http.get(f"https://127.0.0.1:{port}/v1/models").json()["data"][0]["id"] == "model"
        r = http.post(
            f"https://127.0.0.1:{port}/v1/unload_lora_adapter",
            json={"lora_name": "x"},
            headers={"Authorization": "Bearer adm1n"},
        )
        assert r.status_code == 404, r.text  # the admin token got through; the adapter is unknown
    with httpx.Client(timeout=10) as plain, pytest.raises(httpx.HTTPError):
        plain.get(f"http://127.0.0.1:{port}/v1/models")  # plaintext HTTP: no answer
    with httpx.Client(timeout=10) as untrusting, pytest.raises(httpx.ConnectError):
        untrusting.get(f"https://127.0.0.1:{port}/v1/models")  # the system's roots do not know our CA


def _describe(address: str, tls: TLSConfig | None) -> grpc.StatusCode:
    with channel(address, tls) as ch:
        try:
            pb_grpc.ExpertWorkerStub(ch).Describe(pb.DescribeRequest(), timeout=10)
        except grpc.RpcError as e:
            return e.code()
    return grpc.StatusCode.OK


def test_plaintext_clients_are_refused(tls_cluster):
    s, server, _, _, _ = tls_cluster
    with grpc.insecure_channel(s.addr) as ch:
        with pytest.raises(grpc.RpcError) as ei:
            admin_pb2_grpc.AdminStub(ch).ListServers(
                admin_pb2.ListServersRequest(), metadata=auth.metadata("adm1n"), timeout=10
            )
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
    assert health.check(s.addr, 2.0) == "UNREACHABLE"
    assert _describe(server.address, None) == grpc.StatusCode.UNAVAILABLE


def test_the_expert_server_wants_a_client_cert_from_its_ca(tls_cluster):
    _, server, ca, certs, _ = tls_cluster
    assert _describe(server.address, certs["coordinator"]) == grpc.StatusCode.OK
    assert _describe(server.address, TLSConfig(ca=str(ca.path))) == grpc.StatusCode.UNAVAILABLE  # no cert
    rogue = certs["rogue"]
    intruder = TLSConfig(rogue.cert, rogue.key, str(ca.path))  # trusts the server, signed by another CA
    assert _describe(server.address, intruder) == grpc.StatusCode.UNAVAILABLE
    # mutual TLS and the cluster token are independent locks: a good certificate without the token
    with channel(server.address, certs["coordinator"]) as ch:
        with pytest.raises(grpc.RpcError) as ei:
            pb_grpc.ExpertWorkerStub(ch).UnloadAdapter(pb.UnloadAdapterRequest(name="a"), timeout=10)
        assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_tls_config_is_validated(tmp_path):
    (tmp_path / "c.pem").write_text("x")
    with pytest.raises(TLSError, match="go together"):
        TLSConfig(cert=str(tmp_path / "c.pem"))
    with pytest.raises(TLSError, match="no such file"):
        TLSConfig(ca=str(tmp_path / "missing.pem"))
    assert not TLSConfig().client_enabled and not TLSConfig().server_enabled
