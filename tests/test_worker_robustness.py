"""Bad input against a live expert server: each gets its documented status code, and the
server keeps serving correct answers afterwards."""

from __future__ import annotations

import grpc
import pytest
import torch

from coordinator.model.dispatch import stack_experts
from expertmesh import wire
from expertmesh.checkpoint import CheckpointReader
from expertmesh.experts import torch_moe
from expertmesh.v1 import expert_worker_pb2 as pb
from expertmesh.v1 import expert_worker_pb2_grpc as pb_grpc
from expertmesh.v1 import tensor_pb2 as tpb
from expertmesh.worker.server import grpc_options
from tests.cluster_utils import start_server
from tests.hf_models import make_checkpoint

pytestmark = pytest.mark.slow
MAX_MB = 1


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3")
    make_checkpoint("qwen3_moe", path)
    srv = start_server("cpu", path, 0, "--max-message-mb", str(MAX_MB))
    ch = grpc.insecure_channel(srv.address, options=grpc_options(64 << 20))
    grpc.channel_ready_future(ch).result(30)
    stub = pb_grpc.ExpertWorkerStub(ch)
    import time

    from expertmesh.health import check

    for _ in range(100):
        if check(srv.address) == "SERVING":
            break
        time.sleep(0.1)
    yield path, stub, srv
    ch.close()
    srv.stop()


def request(layer=0, t=5, k=2, generation=0, h=64, dtype=torch.float32, slots=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(dtype)
    slot_ids = slots if slots is not None else torch.randint(-1, 8, (t, k), generator=g, dtype=torch.int32)
    w = torch.rand(t, k, generator=g)
    return pb.ForwardRequest(
        seq=1,
        generation=generation,
        layer=layer,
        hidden=wire.encode(x),
        slot_ids=wire.encode(slot_ids),
        weights=wire.encode(w),
    ), (x, slot_ids, w)


def forward(stub, req):
    return list(stub.Forward(iter([req]), timeout=30))


def assert_serves_correctly(path, stub):
    req, (x, s, w) = request(seed=7)
    (resp,) = forward(stub, req)
    reader = CheckpointReader(path)
    w13, w2 = stack_experts(reader, 0, list(range(8)), torch.float32, torch.device("cpu"))
    ref = torch_moe(x, w13, w2, s, w)
    torch.testing.assert_close(wire.decode(resp.output), ref, rtol=1e-5, atol=1e-6)


def bad(field: str, value):
    req, _ = request()
    if field == "hidden":
        req.hidden.CopyFrom(value)
    else:
        setattr(req, field, value)
    return req


CASES = {
    "wrong_dtype": (lambda: request(dtype=torch.bfloat16)[0], grpc.StatusCode.INVALID_ARGUMENT, "dtype"),
    "wrong_shape": (
        lambda: bad("hidden", tpb.Tensor(dtype="float32", shape=[5, 64, 1], data=bytes(5 * 64 * 4))),
        grpc.StatusCode.INVALID_ARGUMENT,
        "shape",
    ),
    "truncated_bytes": (
        lambda: bad("hidden", tpb.Tensor(dtype="float32", shape=[5, 64], data=bytes(100))),
        grpc.StatusCode.INVALID_ARGUMENT,
        "bytes",
    ),
    "hidden_size_mismatch": (lambda: request(h=48)[0], grpc.StatusCode.INVALID_ARGUMENT, "expected [T, 64]"),
    "slot_out_of_range": (
        lambda: request(slots=torch.tensor([[0, 8]] * 5, dtype=torch.int32))[0],
        grpc.StatusCode.INVALID_ARGUMENT,
        "slot ids",
    ),
    "negative_slot": (
        lambda: request(slots=torch.tensor([[0, -2]] * 5, dtype=torch.int32))[0],
        grpc.StatusCode.INVALID_ARGUMENT,
        "slot ids",
    ),
    "unknown_layer": (lambda: request(layer=99)[0], grpc.StatusCode.INVALID_ARGUMENT, "layer 99"),
    "dense_layer": (lambda: request(layer=1)[0], grpc.StatusCode.INVALID_ARGUMENT, "layer 1"),
    "stale_generation": (lambda: request(generation=5)[0], grpc.StatusCode.FAILED_PRECONDITION, "generation"),
    "unknown_dtype": (
        lambda: bad("hidden", tpb.Tensor(dtype="float8", shape=[5, 64], data=bytes(320))),
        grpc.StatusCode.INVALID_ARGUMENT,
        "dtype",
    ),
    "oversized_message": (
        lambda: request(t=(MAX_MB << 20) // 256 + 64)[0],
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_request_gets_status_and_server_keeps_serving(server, case):
    path, stub, srv = server
    make, code, words = CASES[case]
    with pytest.raises(grpc.RpcError) as ei:
        forward(stub, make())
    assert ei.value.code() == code, ei.value.details()
    assert words in (ei.value.details() or "")
    assert srv.proc.poll() is None
    assert_serves_correctly(path, stub)


def test_placement_two_phase(server):
    """PREPARE does not disturb the live set; COMMIT swaps; stale generations are refused."""
    path, stub, _ = server
    live = stub.Describe(pb.DescribeRequest()).generation
    table = [pb.LayerSlots(layer=layer, experts=[7, 6]) for layer in (0, 2)]
    P = pb.ApplyPlacementRequest
    stub.ApplyPlacement(P(phase=P.PREPARE, generation=live + 1, layers=table))
    assert stub.Describe(pb.DescribeRequest()).generation == live
    assert_serves_correctly(path, stub)  # still the old generation and slot table
    stub.ApplyPlacement(P(phase=P.ABORT, generation=live + 1))
    with pytest.raises(grpc.RpcError) as ei:
        stub.ApplyPlacement(P(phase=P.COMMIT, generation=live + 1))
    assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(grpc.RpcError) as ei:
        stub.ApplyPlacement(
            P(phase=P.PREPARE, generation=live + 1, layers=[pb.LayerSlots(layer=0, experts=[9])])
        )
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert_serves_correctly(path, stub)
