"""The host link on a real GPU: the coordinator's decode step is ONE graph that writes each MoE
layer's request into shared memory a CPU expert server's C thread polls, and waits on the
answer's flag; with ``local`` experts the graph computes their share meanwhile.

* float32, every architecture (tiny random models), experts split between ``local`` and the
  CPU server, replicated across both, and every expert on the CPU server: prefill logits and greedy decode equal HF
  transformers' (relative error < 1e-4), tokens identical, and the decode steps ran linked.
* A linked step with bad slot ids is thrown away and runs again without the link (never wrong
  logits), and later steps link again once the server is back.

Runs on the device machine (``python -m pytest -m gpu tests/test_hostlink_gpu.py``).
"""

from __future__ import annotations

import logging
import time

import pytest
import torch

from coordinator.experts.cluster_config import ClusterConfig
from coordinator.experts.expert_conn import ExpertServerError
from expertmesh.checkpoint import CheckpointReader
from tests.cluster_utils import start_server
from tests.hf_models import ARCHS, make_checkpoint
from tests.test_local_member import local_engine, replicas_file, servers
from tests.test_parity import DECODE_STEPS, assert_greedy_matches_hf, hf_greedy

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


@pytest.mark.parametrize("share", ["half_local", "all_cpu", "replicas"])
@pytest.mark.parametrize("arch", ARCHS)
def test_host_link_decode_matches_hf(arch, share, tmp_path):
    hf = make_checkpoint(arch, tmp_path)
    cpu = start_server("cpu", tmp_path)
    ne = CheckpointReader(tmp_path).config.num_experts
    if share == "replicas":  # experts 0..half on local, every expert on the CPU server
        cluster = ClusterConfig(servers(cpu), placement_file=replicas_file(tmp_path, ne))
    else:
        cluster = ClusterConfig(servers(cpu), num_gpu_experts=ne // 2 if share == "half_local" else 0)
    eng, d = local_engine(tmp_path, cluster, "cuda")
    try:
        prompt = torch.randint(0, 96, (12,), generator=torch.Generator().manual_seed(3))
        assert_greedy_matches_hf(eng, hf, prompt)
        assert d.linked_steps == DECODE_STEPS - 1, (d.linked_steps, d.conns[1].link_note)
        assert d.link_reruns == 0
    finally:
        d.close()
        cpu.stop()


def test_a_bad_host_link_step_runs_again_without_the_link(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="expertmesh.remote")
    hf = make_checkpoint("qwen3_moe", tmp_path)
    cpu = start_server("cpu", tmp_path)
    ne = CheckpointReader(tmp_path).config.num_experts
    eng, d = local_engine(tmp_path, ClusterConfig(servers(cpu), num_gpu_experts=ne // 2), "cuda")
    try:
        prompt = torch.randint(0, 96, (12,), generator=torch.Generator().manual_seed(5))
        with torch.no_grad():
            ref_toks, _ = hf_greedy(hf, prompt, 4)
        sid = eng.new_seq()
        toks = [int(eng.step([(sid, prompt.tolist())])[0].argmax())]
        toks.append(int(eng.step([(sid, [toks[-1]])])[0].argmax()))
        assert d.linked_steps == 1
        d.link_table[0].fill_(1 << 20)  # every server slot id of the first MoE layer out of range
        got = None
        deadline = time.monotonic() + 60  # the re-run may wait for the server marked down
        while got is None and time.monotonic() < deadline:
            try:
                got = int(eng.step([(sid, [toks[-1]])])[0].argmax())
            except ExpertServerError:
                time.sleep(0.5)
        assert got is not None, "the server did not come back"
        assert d.link_reruns == 1
        toks.append(got)
        linked = d.linked_steps
        toks.append(int(eng.step([(sid, [toks[-1]])])[0].argmax()))
        assert toks == ref_toks
        # the first step after the server is back may still run unlinked (its new channel's
        # link comes up with the reconnection); the next ones link
        for _ in range(2):
            eng.step([(sid, [toks[-1]])])
        notes = [r.getMessage() for r in caplog.records if "without the link" in r.getMessage()]
        assert d.linked_steps >= linked + 2, f"no step linked after the server came back: {notes}"
    finally:
        d.close()
        cpu.stop()
