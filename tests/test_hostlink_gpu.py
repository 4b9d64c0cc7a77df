"""The host link on a real GPU: the coordinator's decode step is ONE graph that writes each MoE
layer's request into shared memory a CPU expert server's C thread polls, and waits on the
answer's flag; with ``local`` experts the graph computes their share meanwhile.

* float32, every architecture (tiny random models), experts split between ``local`` and the
  CPU server, replicated across both, and every expert on the CPU server: prefill logits and greedy decode equal HF
  transformers' (relative error < 1e-4), tokens identical, and the decode steps ran linked.
* The EPLB recorder wired as the serving engine wires it counts a linked decode's steps as it
  counts the same steps run eagerly.
* A linked step the server refuses (the coordinator's side is launched before the answer is
  read) ends at once and runs without the link, with the same tokens and no server down.
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


def test_linked_steps_count_the_expert_load_as_eager_steps_do(tmp_path):
    """One load call per linked replay (padding rows of the bucket left out) gives the counts the
    eager path's one call per MoE layer gives, fed the same tokens."""
    from coordinator.experts.load_recorder import LoadRecorder

    make_checkpoint("qwen3_moe", tmp_path)
    cpu = start_server("cpu", tmp_path)
    cfg = CheckpointReader(tmp_path).config
    totals = {}
    try:
        for linked in (True, False):
            rec = LoadRecorder(cfg.moe_layer_ids, cfg.num_experts, 64, device="cuda")
            cluster = ClusterConfig(servers(cpu), num_gpu_experts=cfg.num_experts // 2)
            eng, d = local_engine(tmp_path, cluster, "cuda", load_hook=rec.record, step_load=rec.record_step)
            if not linked:
                eng.graphs = None
            try:
                seqs = [eng.new_seq() for _ in range(3)]  # 3 pads the bucket of 4
                eng.step([(s, [(7 * i + j) % 96 for j in range(5)]) for i, s in enumerate(seqs)])
                for t in range(4):
                    eng.step([(s, [(11 * t + 3 * i) % 96]) for i, s in enumerate(seqs)])
                assert d.linked_steps == (4 if linked else 0), (d.linked_steps, d.conns[1].link_note)
            finally:
                d.close()
            snap = rec.snapshot()
            assert snap.steps == 5
            totals[linked] = snap.totals
    finally:
        cpu.stop()
    tokens = 3 * 5 + 4 * 3  # the prefill's, then four decode steps of three
    assert totals[False].sum() == tokens * cfg.top_k * len(cfg.moe_layer_ids)
    assert torch.equal(totals[True], totals[False]), (totals[True], totals[False])


def _two_steps(eng, d, hf, seed: int) -> tuple[int, list[int], list[int]]:
    """A new sequence's prefill and first decode step (linked), its greedy tokens so far, and
    HF's four greedy tokens for the same prompt."""
    prompt = torch.randint(0, 96, (12,), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        ref_toks, _ = hf_greedy(hf, prompt, 4)
    sid = eng.new_seq()
    toks = [int(eng.step([(sid, prompt.tolist())])[0].argmax())]
    toks.append(int(eng.step([(sid, [toks[-1]])])[0].argmax()))
    assert d.linked_steps == 1
    return sid, toks, ref_toks


def test_a_refused_host_link_step_runs_without_the_link_at_once(tmp_path, monkeypatch):
    hf = make_checkpoint("qwen3_moe", tmp_path)
    cpu = start_server("cpu", tmp_path)
    ne = CheckpointReader(tmp_path).config.num_experts
    cluster = ClusterConfig(servers(cpu), num_gpu_experts=ne // 2, timeout_s=30)
    eng, d = local_engine(tmp_path, cluster, "cuda")
    try:
        sid, toks, ref_toks = _two_steps(eng, d, hf, 6)
        conn = d.conns[1]
        real = conn.send_link_step

        def stale(step, rows, bucket, generation, *rest):  # the server refuses another generation
            return real(step, rows, bucket, generation + 1000, *rest)

        monkeypatch.setattr(conn, "send_link_step", stale)
        t0 = time.monotonic()
        toks.append(int(eng.step([(sid, [toks[-1]])])[0].argmax()))
        took = time.monotonic() - t0
        assert took < 10, f"a refused step waited {took:.1f}s (its waits were not cancelled)"
        assert d.linked_steps == 1 and d.link_reruns == 0 and d.expert_cluster.down() == frozenset()
        assert "generation" in conn.link_pause, conn.link_pause
        monkeypatch.undo()
        toks.append(int(eng.step([(sid, [toks[-1]])])[0].argmax()))
        assert d.linked_steps == 2, conn.link_note
        assert toks == ref_toks
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
        sid, toks, ref_toks = _two_steps(eng, d, hf, 5)
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


def test_queued_linked_steps_match_hf(tmp_path):
    """The scheduler queues each linked decode step behind the one running (the server gets its
    LinkStep while the last step still runs): three requests of different lengths decode as
    HF's greedy, the steps linked, and every page comes back."""
    from coordinator.serving.scheduler import Scheduler, SchedulerLimits
    from tests.serving_utils import hf_greedy as hf_tokens
    from tests.test_step_overlap import OUT, PROMPTS, Counting, run_all

    hf = make_checkpoint("qwen3_moe", tmp_path, seed=3)
    refs = [hf_tokens(hf, p, n)[0] for p, n in zip(PROMPTS, OUT)]
    cpu = start_server("cpu", tmp_path)
    ne = CheckpointReader(tmp_path).config.num_experts
    eng, d = local_engine(tmp_path, ClusterConfig(servers(cpu), num_gpu_experts=ne // 2), "cuda")
    s = Scheduler(eng, SchedulerLimits(max_batch_tokens=16, max_running=8, max_context=128))
    assert s.overlap
    n = Counting(eng)
    s.start()
    try:
        assert run_all(s, PROMPTS, OUT) == refs
        assert n.fed > 0 and d.linked_steps > 0, (n.fed, d.linked_steps, d.conns[1].link_note)
        assert d.link_reruns == 0
    finally:
        s.stop()
        d.close()
        cpu.stop()
    assert eng.pages.num_free == eng.pages.num_pages
