"""``--cpu-defer-experts N`` on a CUDA coordinator: a GPU expert server on the GPU and a CPU
expert server, decode replayed from the piecewise graphs (coordinator/model/remote_graphs.py adds the
held-back sums between segments) and run eagerly (the fused CUDA path's Carry).

Reference: HF transformers' Qwen3-MoE on the CPU with the deferral re-stated in plain torch
around its modules (tests/test_deferral.py's DeferredHF). float32 throughout: the Triton path
computes exact fp32 (tests/test_cluster_gpu.py holds it to HF within 1e-4).
"""

from __future__ import annotations

import pytest
import torch

from coordinator.experts.cluster_config import ClusterConfig, ServerSpec
from coordinator.model.engine import Engine
from coordinator.model.remote_graphs import RemoteDecodeGraphs
from expertmesh.checkpoint import CheckpointReader
from expertmesh.demo import write_demo_model
from tests.cluster_utils import start_server
from tests.test_cluster import engine_for
from tests.test_deferral import STEPS, DeferredHF
from tests.test_parity import rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


@pytest.fixture(scope="module")
def gpu_cluster(tmp_path_factory):
    path = write_demo_model(tmp_path_factory.mktemp("defer_gpu") / "model")
    gpu = start_server("gpu", path, 0, "--device", "cuda", "--dtype", "float32", timeout=300)
    cpu = start_server("cpu", path, 0, "--dtype", "float32", timeout=120)
    yield path, gpu, cpu
    gpu.stop()
    cpu.stop()


def greedy(eng: Engine, prompts: list[list[int]], steps: int) -> tuple[list[list[int]], torch.Tensor]:
    """Prefill (every position's logits) then ``steps`` greedy decode steps of all prompts
    together; (tokens per prompt, logits ``[B, prompt + steps, V]``)."""
    seqs = [eng.new_seq() for _ in prompts]
    full = eng.step(list(zip(seqs, prompts)), all_logits=True)  # B x [P, V]
    logits = [[f.cpu()] for f in full]
    toks = [[int(f[-1].argmax())] for f in full]
    for _ in range(steps):
        out = eng.step([(s, [t[-1]]) for s, t in zip(seqs, toks)])
        for i, o in enumerate(out):
            logits[i].append(o.cpu()[None])
            toks[i].append(int(o.argmax()))
    for s in seqs:
        eng.free(s)
    return toks, torch.stack([torch.cat(x) for x in logits])


@pytest.mark.parametrize("gpu_share,n", [("split", 1), ("none", 2)])
def test_graphed_and_eager_deferral_match_the_restated_reference(gpu_cluster, gpu_share, n):
    path, gpu, cpu = gpu_cluster
    ne = CheckpointReader(path).config.num_experts
    gpu_experts = ne // 2 - 1 if gpu_share == "split" else 0
    servers = (ServerSpec("gpu0", gpu.address, "gpu"), ServerSpec("cpu0", cpu.address, "cpu"))
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(2, 700, (12,), generator=g).tolist()
    want_toks, want = DeferredHF(path, gpu_experts, n).greedy(prompt, STEPS)
    _, no_defer = DeferredHF(path, gpu_experts, 0).greedy(prompt, STEPS)
    cluster = ClusterConfig(servers, num_gpu_experts=gpu_experts, cpu_defer_experts=n, timeout_s=120)
    eng, d = engine_for(path, cluster, "cuda")
    try:
        graphs = eng.graphs
        assert isinstance(graphs, RemoteDecodeGraphs)  # deferral no longer forces eager decode
        graphs.timings = []
        toks, got = greedy(eng, [prompt], STEPS)
        layers = len(eng.model.moe_blocks())
        assert len(graphs.timings) == STEPS * layers  # every decode step was replayed
        assert toks[0] == want_toks
        assert rel_err(got[0], want) < 1e-4
        assert rel_err(got[0], no_defer) > 1e-3  # the deferral did change the result
        # batch 3 (pads the bucket of 4), graphed and eager (the fused path's Carry)
        others = [torch.randint(2, 700, (12,), generator=g).tolist() for _ in range(2)]
        graphed_toks, graphed = greedy(eng, [prompt, *others], STEPS)
        eng.graphs = None
        eager_toks, eager = greedy(eng, [prompt, *others], STEPS)
        eng.graphs = graphs
        assert graphed_toks == eager_toks and graphed_toks[0] == want_toks
        assert rel_err(graphed, eager) < 1e-5
        assert rel_err(graphed[0], want) < 1e-4
    finally:
        d.close()
