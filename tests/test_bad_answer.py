"""A misbehaving expert server's answer: a malformed output is that server failing the
layer, as if it had died. With a replica of its experts elsewhere the rows go there (the tokens
of a fault-free run) and the server is marked down with a log line naming it; without one, only
the requests that need its experts fail, with UNAVAILABLE naming the layer, experts and server,
and the other requests of the same steps go on. The hostile servers are the real server command
with one patch (tests/hostile_server.py): answers with a row missing on the gRPC path, corrupted
response descriptors on the shared-memory path."""

from __future__ import annotations

import json
import logging
import sys

import grpc
import pytest
import torch

from coordinator.experts.remote import ClusterConfig, ExpertServerError, ServerSpec
from coordinator.model.dispatch import Dispatcher
from coordinator.model.engine import Engine
from coordinator.serving.sampler import SamplingParams
from coordinator.serving.scheduler import Scheduler, SchedulerLimits
from tests.cluster_utils import _LISTEN, ROOT, ServerProc, spawn, start_server
from tests.hf_models import make_checkpoint
from tests.test_cluster import engine_for
from tests.test_cluster_faults import run_steps
from tests.test_parity import rel_err
from tests.test_serving_scheduler import Collect

pytestmark = pytest.mark.slow

PROMPTS = [[1, 2, 3], [7, 8], [11, 4, 9, 2], [5], [13, 6], [3, 3, 8]]
NEW = 4


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_moe_bad_answer")
    make_checkpoint("qwen3_moe", path)
    return path


@pytest.fixture(scope="module")
def good(ckpt):
    srv = start_server("cpu", ckpt)
    yield srv
    srv.stop()


def start_hostile(ckpt, *mode: str) -> ServerProc:
    cmd = [sys.executable, str(ROOT / "tests" / "hostile_server.py"), *mode]
    proc, lines, m = spawn([*cmd, "cpu-server", "--model", str(ckpt), "--port", "0"], _LISTEN, 60.0)
    return ServerProc("cpu", proc, int(m.group(2)), lines)


def cluster(tmp_path, bad: ServerProc, good: ServerProc, layers: dict, **kw) -> ClusterConfig:
    (tmp_path / "p.json").write_text(json.dumps({"servers": ["bad", "good"], "layers": layers}))
    servers = (ServerSpec("bad", bad.address, "cpu"), ServerSpec("good", good.address, "cpu"))
    return ClusterConfig(servers, placement_file=str(tmp_path / "p.json"), timeout_s=5.0, **kw)


def record_marks(d) -> list[tuple[int, str]]:
    """The cluster's mark_down calls (the connections' down hooks call it too)."""
    marks: list[tuple[int, str]] = []
    mark = d.expert_cluster.mark_down

    def spy(i, error):
        marks.append((i, str(error)))
        mark(i, error)

    d.expert_cluster.mark_down = spy
    return marks


@pytest.mark.parametrize(
    "transport,mode",
    [("grpc", ("shape", "0")), ("grpc", ("bytes",)), ("shm", ("descriptor",)), ("shm", ("seq",))],
)
def test_a_malformed_answer_fails_over_to_a_replica(ckpt, good, tmp_path, caplog, transport, mode):
    bad = start_hostile(ckpt, *mode)
    every = list(range(8))
    # every expert on both; "bad" is listed first, so the static policy sends it every pair
    c = cluster(tmp_path, bad, good, {"*": {"bad": every, "good": every}}, transport=transport)
    try:
        eng, d = engine_for(ckpt, c)
        assert d.conns[0].transport == transport
        marks = record_marks(d)
        prompt = list(range(5, 15))
        want = torch.stack(run_steps(Engine.from_checkpoint(str(ckpt)), prompt, 3))
        with caplog.at_level(logging.ERROR, logger="expertmesh.remote"):
            assert rel_err(torch.stack(run_steps(eng, prompt, 3)), want) < 1e-4
        assert any(i == 0 and "malformed output" in why for i, why in marks), marks
        assert all(i == 0 for i, _ in marks), marks  # the good server is never blamed
        logged = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert any(f"expert server bad ({bad.address}) answered layer" in m for m in logged), logged
        d.close()
    finally:
        bad.stop()


class Spy(Dispatcher):
    """Delegates; records the logical experts that MoE layer ``layer`` routes to."""

    def __init__(self, inner: Dispatcher, layer: int) -> None:
        self.inner, self.layer, self.seen = inner, layer, set()

    def submit(self, layer, x, topk_ids, topk_weights, *args, **kwargs):
        if layer == self.layer:
            self.seen |= set(topk_ids.flatten().tolist())
        return self.inner.submit(layer, x, topk_ids, topk_weights, *args, **kwargs)


def scheduler(eng: Engine) -> Scheduler:
    s = Scheduler(eng, SchedulerLimits(max_batch_tokens=16, max_running=8, max_context=128))
    s.start()
    return s


def submit_all(s: Scheduler) -> list[Collect]:
    outs = [Collect() for _ in PROMPTS]
    for p, c in zip(PROMPTS, outs):
        s.submit(p, SamplingParams(max_new_tokens=NEW, ignore_eos=True), c)
    return outs


def test_without_a_replica_only_the_requests_needing_it_fail(ckpt, good, tmp_path):
    ref_eng = Engine.from_checkpoint(str(ckpt), num_pages=64, page_size=4)
    layer = ref_eng.model.config.moe_layer_ids[0]
    spy = Spy(ref_eng.dispatcher, layer)
    ref_eng.model.attach(spy)
    s = scheduler(ref_eng)
    ref, uses = [], []
    try:
        for p in PROMPTS:  # one at a time: the experts each request's tokens use at `layer`
            spy.seen = set()
            (c,) = [Collect()]
            s.submit(p, SamplingParams(max_new_tokens=NEW, ignore_eos=True), c)
            toks, last = c.run()
            assert last.finish_reason == "length"
            ref.append(toks)
            uses.append(spy.seen)
    finally:
        s.stop()
    # the expert that "bad" alone holds at `layer`: one that splits the requests most evenly
    n = len(PROMPTS)
    e = min(range(8), key=lambda x: abs(sum(x in u for u in uses) - n / 2))
    needing = {i for i, u in enumerate(uses) if e in u}
    assert 0 < len(needing) < n, uses

    bad = start_hostile(ckpt, "shape", str(layer))
    rest = [x for x in range(8) if x != e]
    layers = {"*": {"bad": [], "good": list(range(8))}, str(layer): {"bad": [e], "good": rest}}
    try:
        eng, d = engine_for(ckpt, cluster(tmp_path, bad, good, layers, transport="grpc"))
        marks = record_marks(d)
        s = scheduler(eng)
        try:
            got = [c.run(60.0) for c in submit_all(s)]
        finally:
            s.stop()
        for i, (toks, last) in enumerate(got):
            if i in needing:
                err = last.error
                assert last.finish_reason == "error" and isinstance(err, ExpertServerError), (i, last)
                assert err.code == grpc.StatusCode.UNAVAILABLE, err
                msg = str(err)
                assert f"expert server bad ({bad.address})" in msg and f"[{e}]" in msg, msg
                assert f"layer {layer}" in msg, msg
            else:
                assert last.finish_reason == "length" and toks == ref[i], (i, last, toks, ref[i])
        assert marks and all(i == 0 and "malformed output" in why for i, why in marks), marks
        d.close()
    finally:
        bad.stop()


def test_the_answer_check_names_what_is_wrong():
    from coordinator.experts.remote import _malformed

    assert _malformed(torch.zeros(3, 4), 3, 4) == ""
    assert _malformed(torch.zeros(3, 4, dtype=torch.bfloat16), 3, 4) == ""
    assert _malformed(torch.zeros(3, 5), 3, 4) == "shape [3, 5] for 3 rows of hidden size 4"
    assert _malformed(torch.zeros(12), 3, 4).startswith("shape [12]")
    assert _malformed(torch.zeros(3, 4, dtype=torch.int32), 3, 4).startswith("dtype int32")
    # NaN/Inf are no malformation: a model can produce them (see _malformed's docstring)
    assert _malformed(torch.full((3, 4), float("nan")), 3, 4) == ""
