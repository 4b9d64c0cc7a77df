"""The CUDA IPC fast path on a real GPU: one GPU expert server process and a coordinator
engine in this process on the same GPU. Every data path gives identical logits, and with
CUDA IPC the hidden states and outputs never leave the GPU."""

from __future__ import annotations

import pytest
import torch

from coordinator.experts import remote
from coordinator.experts.remote import ClusterConfig, ServerSpec
from coordinator.model.engine import Engine
from tests.cluster_utils import start_server
from tests.hf_models import make_checkpoint
from tests.test_cluster import engine_for
from tests.test_cluster_faults import run_steps
from tests.test_parity import rel_err
from tests.test_transport_cluster import PROMPT, mapped_segments, wait_until

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def fast_reply_devices(monkeypatch) -> list[torch.device]:
    """The device of every answer read on the fast path from now on (a list this fills)."""
    seen: list[torch.device] = []
    result = remote._FastReply.result

    def spy(self, timeout):
        part = result(self, timeout)
        seen.append(part.device)
        return part

    monkeypatch.setattr(remote._FastReply, "result", spy)
    return seen


def test_cuda_ipc_matches_every_other_path(tmp_path, monkeypatch):
    make_checkpoint("qwen3_moe", tmp_path)
    srv = start_server("gpu", tmp_path, 0, "--device", "cuda", timeout=300)
    servers = (ServerSpec("gpu0", srv.address, "gpu"),)
    seen = fast_reply_devices(monkeypatch)
    try:
        runs = {}
        for transport in ["grpc", "shm", "cuda_ipc", "auto"]:
            eng, d = engine_for(tmp_path, ClusterConfig(servers, transport=transport, timeout_s=120), "cuda")
            seen.clear()
            try:
                runs[transport] = torch.stack(run_steps(eng, PROMPT, 4)).cpu()
                info = d.server_infos()[0]
            finally:
                d.close()
            want = "cuda_ipc" if transport == "auto" else transport
            assert info["transport"] == want, info
            if want == "cuda_ipc":  # every answer was read where the server left it: on the GPU
                assert seen and all(dev.type == "cuda" for dev in seen), seen
            elif want == "shm":
                assert seen and all(dev.type == "cpu" for dev in seen), seen
        for transport, logits in runs.items():
            assert torch.equal(logits, runs["grpc"]), transport
        ref = Engine.from_checkpoint(str(tmp_path), device="cuda")
        want_logits = torch.stack(run_steps(ref, PROMPT, 4)).cpu()
        assert rel_err(runs["cuda_ipc"], want_logits) < 1e-3
        assert wait_until(lambda: not mapped_segments(srv.proc.pid))  # each stream's channel was closed
    finally:
        srv.stop()


def test_host_ring_registration_makes_copies_dma():
    """cuda_ipc.register_host pins a shared-memory segment's ring: torch sees it as pinned and
    copies to and from the GPU give the same bytes."""
    import mmap

    from expertmesh.transport import cuda_ipc

    mm = mmap.mmap(-1, 1 << 20)
    ring = torch.frombuffer(mm, dtype=torch.uint8)
    dev = torch.device("cuda", torch.cuda.current_device())
    assert not ring.is_pinned()
    assert cuda_ipc.register_host(ring, dev)
    try:
        assert ring.is_pinned()
        src = torch.randint(0, 255, (1 << 20,), dtype=torch.uint8, device=dev)
        ring.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(ring.cuda(), src)
        ring[:8].fill_(7)
        assert torch.equal(ring[:4096].to(dev, non_blocking=True).cpu(), ring[:4096])
        assert not cuda_ipc.register_host(ring[1:4097], dev)  # not page-aligned: refused
    finally:
        cuda_ipc.unregister_host(ring, dev)
    del ring
    mm.close()


@pytest.mark.gpu2
def test_cuda_ipc_between_two_gpus(tmp_path, monkeypatch):
    """A GPU expert server on cuda:1, the coordinator on cuda:0: with peer access ``auto`` is
    CUDA IPC (answers read on cuda:0 from the server's GPU ring, never a stale copy), every
    path gives the grpc path's logits, and they match the in-process engine."""
    make_checkpoint("qwen3_moe", tmp_path)
    srv = start_server("gpu", tmp_path, 0, "--device", "cuda:1", timeout=300)
    servers = (ServerSpec("gpu1", srv.address, "gpu"),)
    peer = torch.cuda.can_device_access_peer(0, 1)
    seen = fast_reply_devices(monkeypatch)
    try:
        runs = {}
        for transport in ["grpc", "shm", "auto"]:
            eng, d = engine_for(
                tmp_path, ClusterConfig(servers, transport=transport, timeout_s=120), "cuda:0"
            )
            seen.clear()
            try:
                runs[transport] = torch.stack(run_steps(eng, PROMPT, 6)).cpu()
                info = d.server_infos()[0]
            finally:
                d.close()
            want = ("cuda_ipc" if peer else "shm") if transport == "auto" else transport
            assert info["transport"] == want, info
            if want == "cuda_ipc":
                assert seen and all(dev == torch.device("cuda", 0) for dev in seen), seen
        for transport, logits in runs.items():
            assert torch.equal(logits, runs["grpc"]), transport
        ref = Engine.from_checkpoint(str(tmp_path), device="cuda:0")
        assert rel_err(runs["auto"], torch.stack(run_steps(ref, PROMPT, 6)).cpu()) < 1e-3
    finally:
        srv.stop()
