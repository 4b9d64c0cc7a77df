"""Micro-batched decode (Engine.micro_batches): a decode step split into micro-batches of whole
sequences, pipelined over the layers, gives the un-split step's greedy tokens and log-probs, for
every architecture in process and over the TCP data path to an expert server."""

from __future__ import annotations

import pytest
import torch

from coordinator.experts.remote import ClusterConfig, ServerSpec
from coordinator.model.engine import Engine
from tests.cluster_utils import start_server
from tests.hf_models import ARCHS, make_checkpoint
from tests.test_cluster import engine_for

PROMPTS = [[3 + i, 9, 27 + 2 * i, 5, 11 + i][: 3 + i % 3] for i in range(5)]
STEPS = 5


def decode(eng: Engine, micro: int) -> tuple[list[list[int]], torch.Tensor]:
    """Greedy decode of PROMPTS together; (tokens per sequence, log-probs [STEPS, B, V])."""
    eng.micro_batches = micro
    seqs = [eng.new_seq() for _ in PROMPTS]
    out = eng.step([(s, p) for s, p in zip(seqs, PROMPTS)])
    toks = [[int(o.argmax())] for o in out]
    logps = []
    for _ in range(STEPS):
        out = eng.step([(s, [t[-1]]) for s, t in zip(seqs, toks)])
        logps.append(torch.stack(out).log_softmax(-1))
        for t, o in zip(toks, out):
            t.append(int(o.argmax()))
    for s in seqs:
        eng.free(s)
    return toks, torch.stack(logps)


@pytest.mark.parametrize("arch", ARCHS)
def test_micro_batched_decode_equals_one_batch(arch, tmp_path):
    make_checkpoint(arch, tmp_path)
    eng = Engine.from_checkpoint(str(tmp_path), page_size=4)
    want_toks, want_logp = decode(eng, 1)
    for micro in (2, 3):
        toks, logp = decode(eng, micro)
        assert toks == want_toks, (arch, micro)
        torch.testing.assert_close(logp, want_logp, rtol=0, atol=1e-4)


def test_the_load_hook_sees_a_micro_batched_step_once(tmp_path):
    """EPLB's recorder counts a step at each layer-0 record: a micro-batched step is one step,
    its routed tokens all counted."""
    from coordinator.experts.load_recorder import LoadRecorder

    make_checkpoint("qwen3_moe", tmp_path)
    eng = Engine.from_checkpoint(str(tmp_path), page_size=4)
    cfg = eng.model.config
    rec = LoadRecorder(list(cfg.moe_layer_ids), cfg.num_experts, window_steps=8)
    for blk in eng.model.moe_blocks():
        blk.load_hook = rec.record
    eng.micro_batches = 2
    seqs = [eng.new_seq() for _ in PROMPTS]
    eng.step([(s, p) for s, p in zip(seqs, PROMPTS)])  # a prefill: one step, not split
    before = rec.steps
    eng.step([(s, [1]) for s in seqs])  # a decode of 5 sequences in 2 micro-batches
    assert rec.steps == before + 1
    counted = rec.ring[rec.cursor].sum(-1)  # [L] routed pairs of the step per MoE layer
    assert counted.tolist() == [len(PROMPTS) * cfg.top_k] * len(cfg.moe_layer_ids)


@pytest.mark.slow
def test_micro_batched_decode_over_tcp_equals_one_batch(tmp_path):
    make_checkpoint("qwen2_moe", tmp_path)  # a shared expert too (it runs before the wait)
    srv = start_server("cpu", tmp_path)
    try:
        eng, d = engine_for(
            tmp_path, ClusterConfig((ServerSpec("cpu0", srv.address, "cpu"),), transport="tcp")
        )
        try:
            want_toks, want_logp = decode(eng, 1)
            toks, logp = decode(eng, 2)
            assert d.server_infos()[0]["transport"] == "tcp"
        finally:
            d.close()
        assert toks == want_toks
        torch.testing.assert_close(logp, want_logp, rtol=0, atol=1e-4)
    finally:
        srv.stop()


class _LinkableGraphs:
    """Stands in for the remote decode graphs (coordinator/model/remote_graphs.py): says whether
    a step would link and records the steps handed to it, answering with the eager step's logits."""

    extends = False

    def __init__(self, eng: Engine, links: bool) -> None:
        self.eng, self._links, self.micro, self.ran = eng, links, 1, []

    def bucket(self, b: int) -> int | None:
        return b

    def links(self, b: int) -> bool:
        return self._links

    def run(self, seqs):
        self.ran.append((len(seqs), self.micro))
        from coordinator.model.batch import ForwardBatch

        items = [([tok], past, pages) for tok, past, pages in seqs]
        batch = ForwardBatch.build(items, self.eng.page_size, self.eng.device)
        return self.eng.model(batch, self.eng.cache)


@pytest.mark.parametrize("links", [True, False])
def test_a_step_that_links_goes_to_the_linked_graph_not_to_eager_micro_batches(links, tmp_path, monkeypatch):
    """The linked graph splits a step itself where its link takes micro-batches: a step that can
    link is handed to it (with the engine's count), begin_step once; one that cannot runs the
    eager micro-batches as before."""
    make_checkpoint("qwen3_moe", tmp_path)
    eng = Engine.from_checkpoint(str(tmp_path), page_size=4)
    graphs = eng.graphs = _LinkableGraphs(eng, links)
    eng.micro_batches = 2
    assert graphs.micro == 2, "the engine's count reaches the graphs"
    begun, eager = [], []
    monkeypatch.setattr(eng.dispatcher, "begin_step", lambda n: begun.append(n))
    forward_micro = eng.model.forward_micro
    monkeypatch.setattr(eng.model, "forward_micro", lambda b, c: eager.append(len(b)) or forward_micro(b, c))
    seqs = [eng.new_seq() for _ in PROMPTS]
    eng.step([(s, p) for s, p in zip(seqs, PROMPTS)])  # a prefill: eager, whole
    begun.clear()
    eng.step([(s, [1]) for s in seqs])
    assert begun == [len(PROMPTS)], "begin_step once a step"
    assert (graphs.ran, eager) == (([(len(PROMPTS), 2)], []) if links else ([], [2]))


@pytest.mark.parametrize("links", [True, False])
def test_the_default_splits_only_inside_linked_steps(links, tmp_path, monkeypatch):
    """``None`` (the coordinator's ``--micro-batches auto``) reaches the graphs, which choose per
    bucket; a step that cannot link is never split eagerly."""
    make_checkpoint("qwen3_moe", tmp_path)
    eng = Engine.from_checkpoint(str(tmp_path), page_size=4)
    graphs = eng.graphs = _LinkableGraphs(eng, links)
    eng.micro_batches = None
    assert graphs.micro is None
    eager = []
    forward_micro = eng.model.forward_micro
    monkeypatch.setattr(eng.model, "forward_micro", lambda b, c: eager.append(len(b)) or forward_micro(b, c))
    seqs = [eng.new_seq() for _ in PROMPTS]
    eng.step([(s, p) for s, p in zip(seqs, PROMPTS)])
    eng.step([(s, [1]) for s in seqs])
    assert eager == []
    assert graphs.ran == [(len(PROMPTS), None)]


def test_the_default_count_per_bucket():
    """Two micro-batches where they paid (4-16 rows), whole steps elsewhere; a link that takes
    fewer, a bucket they do not divide or a local share beside the server keeps the step whole."""
    from types import SimpleNamespace

    from coordinator.model.remote_graphs import RemoteDecodeGraphs, auto_micro

    assert [auto_micro(b) for b in (1, 2, 4, 8, 16, 32, 64)] == [1, 1, 2, 2, 2, 1, 1]
    g = SimpleNamespace(micro=None)
    pick = RemoteDecodeGraphs._micro_for.__get__(g)
    relayed, direct = SimpleNamespace(micro=8), SimpleNamespace(micro=1)
    assert [pick(relayed, b, None) for b in (2, 4, 8, 16, 64)] == [1, 2, 2, 2, 1]
    assert pick(direct, 8, None) == 1
    assert pick(relayed, 8, object()) == 1
    g.micro = 3
    assert [pick(relayed, b, None) for b in (3, 6, 8)] == [3, 3, 1]
    g.micro = 1
    assert pick(relayed, 8, None) == 1


def test_the_flag_defaults_to_auto():
    import argparse

    from coordinator.main import add_arguments, config_from_args

    p = argparse.ArgumentParser()
    add_arguments(p)
    parse = lambda *a: config_from_args(p.parse_args(["--model", "m", *a])).micro_batches  # noqa: E731
    assert (parse(), parse("--micro-batches", "auto"), parse("--micro-batches", "2")) == (None, None, 2)
    with pytest.raises(ValueError, match="--micro-batches must be auto or in"):
        parse("--micro-batches", "9")
