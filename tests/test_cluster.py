"""Coordinator engine + a GPU expert server (on the CPU) + a CPU expert server, as separate
processes over loopback gRPC: logits and greedy tokens equal HF transformers'."""

from __future__ import annotations

import json

import pytest
import torch

from coordinator.experts.remote import ClusterConfig, RemoteDispatcher, ServerSpec
from coordinator.model.engine import Engine
from coordinator.model.kv_cache import KVCacheSpec
from coordinator.model.loader import load_model
from expertmesh.checkpoint import CheckpointReader
from expertmesh.v1 import expert_worker_pb2 as pb
from tests.cluster_utils import start_server
from tests.hf_models import make_checkpoint
from tests.test_parity import DECODE_STEPS, assert_greedy_matches_hf

pytestmark = pytest.mark.slow

CLUSTER_ARCHS = ["qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3"]


@pytest.fixture(scope="module", params=CLUSTER_ARCHS)
def cluster(request, tmp_path_factory):
    arch = request.param
    from tests.hf_models import CONFIGS

    if arch not in CONFIGS:
        pytest.fail(f"{arch} has no tiny test config yet")
    path = tmp_path_factory.mktemp(arch)
    hf = make_checkpoint(arch, path, original_format=arch != "qwen2_moe")
    gpu = start_server("gpu", path)
    cpu = start_server("cpu", path)
    yield arch, path, hf, gpu, cpu
    gpu.stop()
    cpu.stop()


def engine_for(path, cluster: ClusterConfig, device: str = "cpu") -> tuple[Engine, RemoteDispatcher]:
    reader = CheckpointReader(path)
    d = RemoteDispatcher(reader.config, cluster, torch.float32, device)
    d.connect(60)
    model = load_model(reader, torch.float32, torch.device(device))
    return Engine(model, d, KVCacheSpec(64, 4), torch.float32, torch.device(device)), d


def placements(gpu, cpu, path, num_experts: int, **cluster_args) -> dict[str, ClusterConfig]:
    """Named placements over the two servers; ``cluster_args`` go to every ClusterConfig
    (e.g. ``transport``)."""
    servers = (ServerSpec("gpu0", gpu.address, "gpu"), ServerSpec("cpu0", cpu.address, "cpu"))
    half = num_experts // 2
    # replicas across both servers: experts 0..half on GPU, everything on CPU (0..half twice)
    spec = {
        "servers": ["gpu0", "cpu0"],
        "layers": {"*": {"gpu0": list(range(half + 1)), "cpu0": list(range(num_experts))}},
    }
    pfile = path / "placement.json"
    pfile.write_text(json.dumps(spec))
    return {
        "all_gpu": ClusterConfig(servers, num_gpu_experts=num_experts, **cluster_args),
        "all_cpu": ClusterConfig(servers, num_gpu_experts=0, **cluster_args),
        "split": ClusterConfig(servers, num_gpu_experts=half - 1, **cluster_args),
        "file_replicas_rr": ClusterConfig(
            servers, placement_file=str(pfile), replica_policy="round_robin", **cluster_args
        ),
        "prefill_threshold": ClusterConfig(
            servers, num_gpu_experts=1, gpu_prefill_token_threshold=8, **cluster_args
        ),
    }


PLACEMENTS = ["all_gpu", "all_cpu", "split", "file_replicas_rr", "prefill_threshold"]


@pytest.mark.parametrize("which", PLACEMENTS)
def test_cluster_matches_hf(cluster, which):
    check_cluster_matches_hf(cluster, which)


def check_cluster_matches_hf(cluster, which: str, **cluster_args) -> list[dict]:
    """Runs prefill + greedy decode over the cluster against HF; returns the server infos
    (tests/test_transport_cluster.py runs it over each data path)."""
    arch, path, hf, gpu, cpu = cluster
    ne = CheckpointReader(path).config.num_experts
    eng, d = engine_for(path, placements(gpu, cpu, path, ne, **cluster_args)[which])
    cpu_conn = d.conns[1]
    cpu_tokens_before = cpu_conn.stub.Stats(pb.StatsRequest()).tokens
    try:
        prompt = torch.randint(0, 96, (12,), generator=torch.Generator().manual_seed(3))
        assert_greedy_matches_hf(eng, hf, prompt)
        assert d.ready()
        cpu_tokens = cpu_conn.stub.Stats(pb.StatsRequest()).tokens - cpu_tokens_before
        moe_layers = len(CheckpointReader(path).config.moe_layer_ids)
        if which == "prefill_threshold":  # the 12-token prefill ran wholly on the GPU server
            assert cpu_tokens <= (DECODE_STEPS - 1) * moe_layers
        elif which == "all_gpu":
            assert cpu_tokens == 0
        else:
            assert cpu_tokens >= 12 * moe_layers // 2
        return d.server_infos()
    finally:
        d.close()
