"""The device link's hand-over on a GPU (expertmesh/transport/link.py): two streams of one
process stand in for the coordinator and the expert server (on one GPU their kernels run
concurrently; two processes would time-slice). Checks the payload arrives whole for every
layer of several steps, inside CUDA graphs, and that a peer that never signals costs one
timeout and lets the rest of the step run through."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from expertmesh.transport import link

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

R, H, K, LAYERS = 4, 256, 2, 3


class _Side:
    def __init__(self, dev):
        self.step = link.StepWord(dev)
        self.abort = torch.zeros(1, dtype=torch.int64, device=dev)
        self.errors = torch.zeros(1, dtype=torch.int64, device=dev)
        self.stream = torch.cuda.Stream(dev)


def _pair():
    dev = torch.device("cuda", torch.cuda.current_device())
    link.warm_up(dev)
    req = link.RequestViews.of(
        link.new_area(link.request_bytes(R, H, K, torch.bfloat16), dev), R, H, K, torch.bfloat16
    )
    ans = link.AnswerViews.of(
        link.new_area(link.answer_bytes(R, H, torch.bfloat16), dev), R, H, torch.bfloat16
    )
    return dev, req, ans, _Side(dev), _Side(dev)


def _coordinator_step(c, req, ans, xs, outs, timeout_s=5.0):
    """Per layer: publish x, wait for the answer, keep it (what a linked chain does)."""
    c.step.copy_in()
    for i in range(LAYERS):
        req.x.copy_(xs[i])
        req.ids.fill_(i)
        link.signal(req.flag, c.step.step, i)
        link.wait(ans.flag, c.step.step, i, c.abort, c.errors, timeout_s)
        outs[i].copy_(ans.out)


def _server_step(s, req, ans, timeout_s=5.0):
    """Per layer: wait for the request, answer x * 2 + ids[0] (a stand-in for the MoE)."""
    s.step.copy_in()
    for i in range(LAYERS):
        link.wait(req.flag, s.step.step, i, s.abort, s.errors, timeout_s)
        ans.out.copy_(req.x * 2 + req.ids[:, :1].to(req.x.dtype))
        link.signal(ans.flag, s.step.step, i)


def test_layers_hand_over_eagerly_and_in_graphs():
    dev, req, ans, c, s = _pair()
    xs = [torch.randn(R, H, device=dev, dtype=torch.bfloat16) for _ in range(LAYERS)]
    outs = [torch.zeros(R, H, device=dev, dtype=torch.bfloat16) for _ in range(LAYERS)]
    want = [x * 2 + i for i, x in enumerate(xs)]
    # step 0 on one stream, layer by layer: every kernel of both sides loaded before any spins
    # (the module's NOTE on lazy loading)
    s.step.set(0, R)
    s.step.copy_in()
    c.step.set(0, R)
    c.step.copy_in()
    for i in range(LAYERS):
        req.x.copy_(xs[i])
        req.ids.fill_(i)
        link.signal(req.flag, c.step.step, i)
        link.wait(req.flag, s.step.step, i, s.abort, s.errors, 1.0)
        ans.out.copy_(req.x * 2 + req.ids[:, :1].to(req.x.dtype))
        link.signal(ans.flag, s.step.step, i)
        link.wait(ans.flag, c.step.step, i, c.abort, c.errors, 1.0)
        outs[i].copy_(ans.out)
    torch.cuda.synchronize()
    assert int(c.errors) == 0 and int(s.errors) == 0
    for step in (1, 2):  # eager, server launched first then coordinator
        s.step.set(step, R)
        c.step.set(step, R)
        with torch.cuda.stream(s.stream):
            _server_step(s, req, ans)
        with torch.cuda.stream(c.stream):
            _coordinator_step(c, req, ans, xs, outs)
        torch.cuda.synchronize()
        assert int(c.errors) == 0 and int(s.errors) == 0
        for o, w in zip(outs, want):
            torch.testing.assert_close(o, w, rtol=0, atol=0)
    gs, gc = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(gs, stream=s.stream):
        _server_step(s, req, ans)
    with torch.cuda.graph(gc, stream=c.stream):
        _coordinator_step(c, req, ans, xs, outs)
    torch.cuda.synchronize()
    for step in range(3, 8):
        for o in outs:
            o.zero_()
        for x in xs:
            x.normal_()
        want = [x * 2 + i for i, x in enumerate(xs)]
        torch.cuda.synchronize()
        s.step.set(step, R)
        c.step.set(step, R)
        with torch.cuda.stream(c.stream):  # NOTE: the coordinator first: its waits must hold
            gc.replay()
            c.step.replayed()
        with torch.cuda.stream(s.stream):
            gs.replay()
            s.step.replayed()
        torch.cuda.synchronize()
        assert int(c.errors) == 0 and int(s.errors) == 0
        for o, w in zip(outs, want):
            torch.testing.assert_close(o, w, rtol=0, atol=0)


def test_a_silent_peer_costs_one_timeout():
    dev, req, ans, c, s = _pair()
    xs = [torch.randn(R, H, device=dev, dtype=torch.bfloat16) for _ in range(LAYERS)]
    outs = [torch.zeros(R, H, device=dev, dtype=torch.bfloat16) for _ in range(LAYERS)]
    c.step.set(1, R)
    t0 = time.perf_counter()
    with torch.cuda.stream(c.stream):  # no server: layer 0 times out, the others run through
        _coordinator_step(c, req, ans, xs, outs, timeout_s=0.2)
    torch.cuda.synchronize()
    took = time.perf_counter() - t0
    assert int(c.errors) == link.ERR_TIMEOUT and int(c.abort) == 1
    assert 0.2 <= took < 0.2 * LAYERS, took


def test_the_host_cancels_a_spinning_step():
    """A peer whose stream ended: the host's Canceller ends the step long before its timeout."""
    dev, req, ans, c, s = _pair()
    xs = [torch.randn(R, H, device=dev, dtype=torch.bfloat16) for _ in range(LAYERS)]
    outs = [torch.zeros(R, H, device=dev, dtype=torch.bfloat16) for _ in range(LAYERS)]
    cancel = link.Canceller(c.abort)
    cancel(0)  # its copy path used once before anything spins
    c.step.set(1, R)
    t0 = time.perf_counter()
    with torch.cuda.stream(c.stream):  # no server; a 30 s timeout
        _coordinator_step(c, req, ans, xs, outs, timeout_s=30.0)
    threading.Timer(0.3, cancel, args=(1,)).start()  # another thread, as the stream's reader
    torch.cuda.synchronize()
    took = time.perf_counter() - t0
    assert int(c.errors) == link.ERR_TIMEOUT and int(c.abort) == 1
    assert 0.3 <= took < 5.0, took
