"""The TCP data path with a CUDA coordinator and a GPU expert server (its CUDA
graphs): the same logits as plain gRPC, greedy tokens equal to the in-process engine's; with
two GPUs, a server on the second GPU (what stands in for another machine)."""

from __future__ import annotations

import pytest
import torch

from coordinator.experts.remote import ClusterConfig, ServerSpec
from coordinator.model.engine import Engine
from tests.cluster_utils import start_server
from tests.hf_models import make_checkpoint
from tests.test_cluster import engine_for
from tests.test_cluster_faults import run_steps
from tests.test_transport_cluster import PROMPT

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def _tcp_equals_grpc(tmp_path, device: str) -> None:
    make_checkpoint("qwen3_moe", tmp_path)
    srv = start_server("gpu", tmp_path, 0, "--device", device, timeout=300)
    servers = (ServerSpec("gpu0", srv.address, "gpu"),)
    try:
        runs = {}
        for transport in ["grpc", "tcp"]:
            # NOTE: the link off: these are the per-layer paths (tests/test_tcp_relay_gpu.py
            # checks a relayed linked step, which a second GPU would take over tcp)
            cfg = ClusterConfig(servers, transport=transport, timeout_s=120, device_link="off")
            eng, d = engine_for(tmp_path, cfg, "cuda")
            try:
                runs[transport] = torch.stack(run_steps(eng, PROMPT, 6)).cpu()
                assert d.server_infos()[0]["transport"] == transport
            finally:
                d.close()
        assert torch.equal(runs["tcp"], runs["grpc"])
        ref = Engine.from_checkpoint(str(tmp_path), device="cuda")
        want = torch.stack(run_steps(ref, PROMPT, 6)).cpu()
        assert runs["tcp"].argmax(-1).tolist() == want.argmax(-1).tolist()
    finally:
        srv.stop()


def test_tcp_same_gpu_equals_grpc(tmp_path):
    _tcp_equals_grpc(tmp_path, "cuda:0")


@pytest.mark.gpu2
def test_tcp_second_gpu_equals_grpc(tmp_path):
    _tcp_equals_grpc(tmp_path, "cuda:1")


def test_micro_batched_decode_on_cuda_over_tcp(tmp_path):
    """The micro-batched step (eager on CUDA) gives the graphed un-split step's greedy tokens."""
    from tests.test_micro_batches import decode

    make_checkpoint("qwen2_moe", tmp_path)
    srv = start_server("gpu", tmp_path, 0, "--device", "cuda:0", timeout=300)
    try:
        eng, d = engine_for(
            tmp_path, ClusterConfig((ServerSpec("gpu0", srv.address, "gpu"),), transport="tcp"), "cuda"
        )
        try:
            want_toks, want_logp = decode(eng, 1)
            toks, logp = decode(eng, 2)
        finally:
            d.close()
        assert toks == want_toks
        torch.testing.assert_close(logp.cpu(), want_logp.cpu(), rtol=0, atol=1e-3)
    finally:
        srv.stop()
