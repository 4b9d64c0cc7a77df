"""The relayed link over the TCP data path with a CUDA coordinator (its decode step ONE graph
over host areas that the relay carries to the server; expertmesh/transport/tcp_relay.py):

* ``gpu``: a CPU expert server over ``--transport tcp`` (its host-link C thread reads the
  relay's areas), every expert there or half of them in the coordinator's process: greedy
  decode equal to HF transformers', every decode step linked.
* ``gpu``: a GPU expert server on the coordinator's GPU with EXPERTMESH_LINK=force (its step
  graphs over the relay's areas mapped into its GPU): decode equal to in process, linked.
* ``gpu2``: the GPU server on cuda:1, the coordinator on cuda:0 (the second GPU stands in for
  another machine; the link crosses by TCP, not NVLink): the same.
* micro-batches (``gpu``: a CPU server, with and without a shared expert; ``gpu2``: the GPU
  server on cuda:1): the linked step split in 2 or 3 micro-batches inside its graph gives the
  un-split linked step's greedy tokens and logits, every decode step linked and split.

Runs on the device machine (``python -m pytest -m "gpu or gpu2" tests/test_tcp_relay_gpu.py``).
"""

from __future__ import annotations

import pytest
import torch

from coordinator.experts.cluster_config import ClusterConfig, ServerSpec
from expertmesh.checkpoint import CheckpointReader
from tests.cluster_utils import start_server
from tests.hf_models import make_checkpoint
from tests.test_link_e2e import _check_linked_decode
from tests.test_local_member import local_engine
from tests.test_parity import DECODE_STEPS, assert_greedy_matches_hf, rel_err
from tests.test_remote_graphs import decode

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


@pytest.mark.parametrize("share", ["half_local", "all_cpu"])
def test_cpu_server_over_tcp_decodes_linked_as_hf(share, tmp_path):
    hf = make_checkpoint("qwen3_moe", tmp_path)
    cpu = start_server("cpu", tmp_path)
    ne = CheckpointReader(tmp_path).config.num_experts
    specs = (ServerSpec.local(), ServerSpec("cpu0", cpu.address, "cpu"))
    cluster = ClusterConfig(
        specs, transport="tcp", timeout_s=30, num_gpu_experts=ne // 2 if share == "half_local" else 0
    )
    eng, d = local_engine(tmp_path, cluster, "cuda")
    try:
        conn = d.conns[1]
        assert conn.transport == "tcp" and conn.link() is not None, conn.link_note
        prompt = torch.randint(0, 96, (12,), generator=torch.Generator().manual_seed(3))
        assert_greedy_matches_hf(eng, hf, prompt)
        assert d.linked_steps == DECODE_STEPS - 1, (d.linked_steps, conn.link_note)
        assert d.link_reruns == 0
    finally:
        d.close()
        cpu.stop()


def _gpu_server_over_tcp(tmp_path, monkeypatch, server_device: str, mode: str) -> None:
    from tests.test_cluster import engine_for

    make_checkpoint("qwen3_moe", tmp_path)
    if mode == "auto":
        monkeypatch.delenv("EXPERTMESH_LINK", raising=False)
    else:
        monkeypatch.setenv("EXPERTMESH_LINK", mode)
    srv = start_server("gpu", tmp_path, 0, "--device", server_device, timeout=300)
    spec = ServerSpec("gpu0", srv.address, "gpu")
    eng, d = engine_for(tmp_path, ClusterConfig((spec,), transport="tcp", timeout_s=60), "cuda:0")
    try:
        conn = d.conns[0]
        assert conn.transport == "tcp" and conn.link() is not None, conn.link_note
        _check_linked_decode(tmp_path, eng, d)
    finally:
        d.close()
        srv.stop()


def test_gpu_server_on_this_gpu_over_tcp_decodes_linked(tmp_path, monkeypatch):
    _gpu_server_over_tcp(tmp_path, monkeypatch, "cuda:0", "force")


@pytest.mark.gpu2
def test_gpu_server_on_the_second_gpu_over_tcp_decodes_linked(tmp_path, monkeypatch):
    _gpu_server_over_tcp(tmp_path, monkeypatch, "cuda:1", "auto")


def _micro_equals_whole(eng, d, micros=(2, 3)) -> None:
    """Decodes batches 4 and 3 (a padded bucket) whole, then in micro-batches; both linked."""
    from coordinator.model.remote_graphs import RemoteDecodeGraphs

    graphs = eng.graphs
    assert isinstance(graphs, RemoteDecodeGraphs)
    for batch in (4, 3):
        eng.micro_batches = 1
        before = d.linked_steps
        want = decode(eng, batch, 6)
        why = [getattr(c, "link_pause", "") for c in d.conns]
        assert d.linked_steps - before == 5, (batch, d.linked_steps - before, why)
        for micro in micros:
            if 4 % micro:
                continue  # a bucket of 4 splits in 2 or 4 (else the step runs whole, linked)
            eng.micro_batches = micro
            before, split = d.linked_steps, d.linked_micro_steps
            got = decode(eng, batch, 6)
            why = [getattr(c, "link_pause", "") for c in d.conns]
            assert d.linked_steps - before == 5 and d.linked_micro_steps - split == 5, (batch, micro, why)
            assert torch.equal(got.argmax(-1), want.argmax(-1)), (batch, micro)
            assert rel_err(got, want) < 1e-4, (batch, micro)
    eng.micro_batches = 1
    assert d.link_reruns == 0


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])  # qwen2_moe: a shared expert
def test_micro_batched_linked_steps_over_tcp_equal_whole_ones(arch, tmp_path):
    from tests.test_cluster import engine_for

    make_checkpoint(arch, tmp_path)
    cpu = start_server("cpu", tmp_path)
    cluster = ClusterConfig((ServerSpec("cpu0", cpu.address, "cpu"),), transport="tcp", timeout_s=30)
    eng, d = engine_for(tmp_path, cluster, "cuda:0")
    try:
        conn = d.conns[0]
        lnk = conn.link()
        assert conn.transport == "tcp" and lnk is not None and lnk.micro >= 2, conn.link_note
        _micro_equals_whole(eng, d, (2, 4))
    finally:
        d.close()
        cpu.stop()


@pytest.mark.gpu2
def test_micro_batched_linked_steps_to_the_second_gpu_equal_whole_ones(tmp_path, monkeypatch):
    from tests.test_cluster import engine_for

    make_checkpoint("qwen3_moe", tmp_path)
    monkeypatch.delenv("EXPERTMESH_LINK", raising=False)
    srv = start_server("gpu", tmp_path, 0, "--device", "cuda:1", timeout=300)
    cluster = ClusterConfig((ServerSpec("gpu0", srv.address, "gpu"),), transport="tcp", timeout_s=60)
    eng, d = engine_for(tmp_path, cluster, "cuda:0")
    try:
        assert d.conns[0].link() is not None, d.conns[0].link_note
        _micro_equals_whole(eng, d, (2, 4))
    finally:
        d.close()
        srv.stop()
