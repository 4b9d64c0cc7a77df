"""The control plane is not open to every client: an expert server with a cluster token refuses
placement/adapter pushes without it (the coordinator sends it), the coordinator's Admin needs
its admin token when one is set and answers only loopback peers when none is."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from coordinator.config import CoordinatorConfig
from expertmesh import auth, errors
from expertmesh.experts import TorchExpertBackend
from expertmesh.v1 import admin_pb2, admin_pb2_grpc
from expertmesh.v1 import expert_worker_pb2 as pb
from expertmesh.v1 import expert_worker_pb2_grpc as pb_grpc
from expertmesh.worker.config import WorkerConfig
from expertmesh.worker.server import start_worker
from tests.hf_models import make_checkpoint
from tests.serving_utils import ServerThread


@pytest.mark.parametrize(
    "peer, local",
    [
        ("ipv4:127.0.0.1:5000", True),
        ("ipv4:127.8.0.3:1", True),
        ("ipv6:[::1]:5000", True),
        ("ipv6:[::ffff:127.0.0.1]:5000", True),
        ("unix:/tmp/x.sock", True),
        ("ipv4:10.0.0.7:5000", False),
        ("ipv4:128.0.0.1:5000", False),
        ("ipv6:[2001:db8::1]:5000", False),
        ("", False),
    ],
)
def test_local_peers(peer, local):
    assert auth.is_local_peer(peer) is local
    if not local:
        with pytest.raises(errors.PermissionDenied, match="loopback peers"):
            auth.check_local(peer, "Admin")


def test_token_check():
    auth.check_token(None, [], "x")  # no token set: open
    auth.check_token("s3cret", [("authorization", "Bearer s3cret")], "x")
    auth.check_token("s3cret", (("Authorization", b"Bearer s3cret"),), "x")
    for bad in ([], [("authorization", "Bearer nope")], [("authorization", "s3cret")], None):
        with pytest.raises(errors.Unauthenticated, match="needs the token"):
            auth.check_token("s3cret", bad, "ApplyPlacement")


def test_expert_server_refuses_control_rpcs_without_the_cluster_token(tmp_path):
    make_checkpoint("qwen3_moe", tmp_path)
    P = pb.ApplyPlacementRequest

    async def main() -> None:
        config = WorkerConfig("cpu", str(tmp_path), port=0, experts="none", cluster_token="s3cret")
        w = await start_worker(config, TorchExpertBackend())
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{w.port}") as ch:
                stub = pb_grpc.ExpertWorkerStub(ch)
                prep = P(phase=P.PREPARE, generation=1, layers=[pb.LayerSlots(layer=0, experts=[0])])
                for call, req in (
                    (stub.ApplyPlacement, prep),
                    (stub.LoadAdapter, pb.LoadAdapterRequest(name="a")),
                    (stub.UnloadAdapter, pb.UnloadAdapterRequest(name="a")),
                ):
                    with pytest.raises(grpc.aio.AioRpcError) as ei:
                        await call(req, metadata=auth.metadata("wrong"))
                    assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED, ei.value.details()
                assert (await stub.Describe(pb.DescribeRequest())).generation == 0  # reads stay open
                await stub.ApplyPlacement(prep, metadata=auth.metadata("s3cret"))
                await stub.ApplyPlacement(P(phase=P.COMMIT, generation=1), metadata=auth.metadata("s3cret"))
                assert (await stub.Describe(pb.DescribeRequest())).generation == 1
        finally:
            await w.stop(0)

    asyncio.run(main())
    assert "s3cret" not in repr(WorkerConfig("cpu", "m", cluster_token="s3cret"))


def test_admin_needs_the_admin_token_when_one_is_set(tmp_path):
    make_checkpoint("qwen3_moe", tmp_path)
    config = CoordinatorConfig(model_dir=str(tmp_path), port=0, admin_token="adm1n")
    with ServerThread(config) as s, grpc.insecure_channel(s.addr) as ch:
        admin = admin_pb2_grpc.AdminStub(ch)
        for md in ((), auth.metadata("wrong")):
            with pytest.raises(grpc.RpcError) as ei:
                admin.ListServers(admin_pb2.ListServersRequest(), metadata=md)
            assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
        admin.ListServers(admin_pb2.ListServersRequest(), metadata=auth.metadata("adm1n"))
        admin.GetExpertLoad(admin_pb2.GetExpertLoadRequest(), metadata=auth.metadata("adm1n"))
    assert "adm1n" not in repr(config)
