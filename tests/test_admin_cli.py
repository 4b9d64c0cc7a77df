"""The admin token where users need it: the CLI's admin verbs send ``--admin-token`` /
``EXPERTMESH_ADMIN_TOKEN``; the HTTP admin endpoints (LoRA load/unload) need it when one is set
(401 without) and, with none set, answer loopback peers only (403), through real HTTP clients;
``expertmesh up`` gives its children a fresh cluster token through the environment, never argv."""

from __future__ import annotations

import argparse
import asyncio

import grpc
import httpx
import pytest

from coordinator.serving.http.app import create_app
from coordinator.serving.server import CoordinatorConfig
from expertmesh import auth, launcher
from expertmesh.cli import main as cli
from expertmesh.v1 import admin_pb2, admin_pb2_grpc
from tests.hf_models import make_checkpoint
from tests.serving_utils import ServerThread, one_thread  # noqa: F401 (autouse fixture)

TOKEN = "adm1n-t0ken"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("admin")
    make_checkpoint("qwen3_moe", root / "model")
    (root / "adapters").mkdir()
    return root


@pytest.fixture(scope="module")
def with_token(model):
    cfg = CoordinatorConfig(
        model_dir=str(model / "model"),
        port=0,
        http_port=0,
        lora_dirs=(str(model / "adapters"),),
        admin_token=TOKEN,
    )
    with ServerThread(cfg) as s:
        yield s


def test_admin_verbs_send_the_token(with_token, capsys, monkeypatch):
    addr = with_token.addr
    monkeypatch.delenv(auth.ADMIN_TOKEN_ENV, raising=False)
    for argv in (
        ["status", "--interval", "0.05", "--json"],
        ["lora", "list"],
        ["placement", "show"],
        ["load"],
    ):
        assert cli([*argv, "--addr", addr]) == 1, argv
        assert "UNAUTHENTICATED" in capsys.readouterr().err
        assert cli([*argv, "--addr", addr, "--admin-token", "wrong"]) == 1, argv
        assert "UNAUTHENTICATED" in capsys.readouterr().err
        assert cli([*argv, "--addr", addr, "--admin-token", TOKEN]) == 0, argv
        capsys.readouterr()
    monkeypatch.setenv(auth.ADMIN_TOKEN_ENV, TOKEN)
    assert cli(["status", "--interval", "0.05", "--json", "--addr", addr]) == 0
    assert '"placement_generation"' in capsys.readouterr().out
    assert cli(["lora", "unload", "nope", "--addr", addr]) == 1  # past the token: the name is unknown
    assert "NOT_FOUND" in capsys.readouterr().err


def test_http_admin_endpoints_need_the_token_when_set(with_token, model):
    base = f"http://127.0.0.1:{with_token.server.http.port}/v1"
    outside = str(model / "model")  # a directory, but not under --lora-dir
    with httpx.Client(timeout=30) as http:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
            for path, body in (
                ("load_lora_adapter", {"lora_name": "x", "lora_path": outside}),
                ("unload_lora_adapter", {"lora_name": "x"}),
            ):
                r = http.post(f"{base}/{path}", json=body, headers=headers)
                assert r.status_code == 401, (path, headers, r.text)
                assert "token" in r.json()["error"]["message"]
        ok = {"Authorization": f"Bearer {TOKEN}"}
        r = http.post(f"{base}/unload_lora_adapter", json={"lora_name": "x"}, headers=ok)
        assert r.status_code == 404, r.text  # authorized: the adapter is unknown
        escapes = [outside, str(model / "adapters" / ".." / "model"), str(model / "adapters" / "out")]
        (model / "adapters" / "out").symlink_to(model / "model", target_is_directory=True)
        for path in escapes:
            r = http.post(f"{base}/load_lora_adapter", json={"lora_name": "x", "lora_path": path}, headers=ok)
            assert r.status_code == 403 and "--lora-dir" in r.json()["error"]["message"], path
            assert r.json()["error"]["param"] == "lora_path", r.text
        # each refusal names the field it is about
        for body, status, param in (
            ({"lora_name": "x", "lora_path": str(model / "adapters" / "missing")}, 400, "lora_path"),
            ({"lora_name": "", "lora_path": str(model / "adapters")}, 400, "lora_name"),
        ):
            r = http.post(f"{base}/load_lora_adapter", json=body, headers=ok)
            assert (r.status_code, r.json()["error"]["param"]) == (status, param), r.text
        with grpc.insecure_channel(with_token.addr) as ch:  # the same over gRPC
            for path in escapes:
                with pytest.raises(grpc.RpcError) as ei:
                    admin_pb2_grpc.AdminStub(ch).LoadLoRA(
                        admin_pb2.LoadLoRARequest(name="x", path=path),
                        metadata=auth.metadata(TOKEN),
                        timeout=30,
                    )
                assert ei.value.code() == grpc.StatusCode.PERMISSION_DENIED, path
        assert http.get(f"{base}/models").status_code == 200  # the public API needs no token


def test_http_admin_endpoints_without_a_token_answer_loopback_only(model):
    cfg = CoordinatorConfig(model_dir=str(model / "model"), port=0, lora_dirs=(str(model / "adapters"),))
    with ServerThread(cfg) as s:
        app = create_app(s.server)

        async def post(client_ip: str) -> httpx.Response:
            transport = httpx.ASGITransport(app=app, client=(client_ip, 40000))
            async with httpx.AsyncClient(transport=transport, base_url="http://coordinator") as http:
                return await http.post("/v1/unload_lora_adapter", json={"lora_name": "x"})

        async def all_peers() -> dict[str, httpx.Response]:
            ips = ("127.0.0.1", "::1", "::ffff:127.0.0.1", "192.0.2.7", "2001:db8::5", "::ffff:10.0.0.1")
            return {ip: await post(ip) for ip in ips}

        got = asyncio.run_coroutine_threadsafe(all_peers(), s._loop).result(60)  # the server's loop
    for ip in ("127.0.0.1", "::1", "::ffff:127.0.0.1"):
        assert got[ip].status_code == 404, (ip, got[ip].text)  # allowed: unknown adapter
    for ip in ("192.0.2.7", "2001:db8::5", "::ffff:10.0.0.1"):
        assert got[ip].status_code == 403, (ip, got[ip].text)
        assert "loopback only" in got[ip].json()["error"]["message"]


def _up_args(**kw) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    launcher.add_arguments(p)
    return p.parse_args([f"--{k.replace('_', '-')}={v}" for k, v in kw.items()])


def test_up_generates_a_cluster_token_and_passes_it_by_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(auth.CLUSTER_TOKEN_ENV, raising=False)
    args = _up_args(device="cpu")
    gpu, cpu, coord_cmd = launcher.build_children(args, tmp_path, 8)
    env_a = launcher.child_env()
    token = env_a[auth.CLUSTER_TOKEN_ENV]
    assert len(token) >= 32
    for cmd in (gpu.cmd, cpu.cmd, coord_cmd):  # never on a command line (`ps` shows those)
        assert token not in " ".join(cmd) and "--cluster-token" not in cmd
    assert launcher.child_env()[auth.CLUSTER_TOKEN_ENV] != token  # fresh each time
    monkeypatch.setenv(auth.CLUSTER_TOKEN_ENV, "mine")  # one the operator chose is kept
    assert launcher.child_env()[auth.CLUSTER_TOKEN_ENV] == "mine"


def test_tokens_from_a_file_named_by_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(auth.CLUSTER_TOKEN_ENV, raising=False)
    monkeypatch.delenv(f"{auth.CLUSTER_TOKEN_ENV}_FILE", raising=False)
    assert auth.token_from_env(auth.CLUSTER_TOKEN_ENV) is None
    (tmp_path / "t").write_text("fr0m-file\n")
    monkeypatch.setenv(f"{auth.CLUSTER_TOKEN_ENV}_FILE", str(tmp_path / "t"))
    assert auth.token_from_env(auth.CLUSTER_TOKEN_ENV) == "fr0m-file"
    monkeypatch.setenv(auth.CLUSTER_TOKEN_ENV, "direct")  # the variable itself wins
    assert auth.token_from_env(auth.CLUSTER_TOKEN_ENV) == "direct"
    monkeypatch.setenv(auth.CLUSTER_TOKEN_ENV, "")
    monkeypatch.setenv(f"{auth.CLUSTER_TOKEN_ENV}_FILE", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="cannot read the token"):
        auth.token_from_env(auth.CLUSTER_TOKEN_ENV)


def test_unreadable_tls_or_token_files_are_clear_errors(tmp_path, capsys, monkeypatch):
    missing = str(tmp_path / "missing.pem")
    for argv in (
        ["status", "--tls-ca", missing],
        ["cpu-server", "--model", str(tmp_path), "--tls-cert", missing, "--tls-key", missing],
        ["coordinator", "--model", str(tmp_path), "--tls-ca", missing],
    ):
        assert cli(argv) == 2, argv
        assert f"{missing}: no such file" in capsys.readouterr().err
    monkeypatch.delenv(auth.ADMIN_TOKEN_ENV, raising=False)
    monkeypatch.setenv(f"{auth.ADMIN_TOKEN_ENV}_FILE", missing)
    assert cli(["load"]) == 2
    assert "cannot read the token" in capsys.readouterr().err
