"""The relay under a real coordinator graph: a CUDA graph writes each layer into the
coordinator's host areas mapped into the GPU (as the coordinator maps a host link) and polls
the answer flag there with link.py's kernels; the relays carry the layers over loopback to a
Python compute on the server's areas. Answers must equal the compute's arithmetic done here on
the graph's inputs, eagerly and on graph replays, at 1 row and at a padded bucket."""

from __future__ import annotations

import pytest
import torch

from expertmesh.transport import link
from expertmesh.transport import relay as rl
from tests.relay_utils import DT, Compute, H, K, R, expected, pair

# NOTE: conftest.py skips `gpu` tests where there is no GPU; a missing relay build fails
pytestmark = pytest.mark.gpu

LAYERS = 4


def test_a_cuda_graph_over_mapped_host_areas_talks_through_two_relays():
    from expertmesh.transport.host_map import HostMapped

    dev = torch.device("cuda", torch.cuda.current_device())
    link.warm_up(dev)
    span, req_h, ans_h = rl.host_areas(R, H, K, DT)
    gen = torch.Generator().manual_seed(0)
    with pair(co_areas=(req_h, ans_h), co_cfg=rl.RelayConfig(timeout_s=10.0)) as (co, srv, _):
        mapped = HostMapped(span, dev)
        try:
            ans_at = ans_h.data_ptr() - span.data_ptr()
            req = link.RequestViews.of(mapped.tensor[:ans_at], R, H, K, DT)
            ans = link.AnswerViews.of(mapped.tensor[ans_at:], R, H, DT)
            word = link.StepWord(dev)
            abort, errors = (torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(2))
            stream, compute, step = torch.cuda.Stream(dev), Compute(srv), 1
            for tb, real in ((1, 1), (R, 5)):
                xs = torch.zeros(LAYERS, tb, H, dtype=DT, device=dev)  # [L, tb, H]
                ids = torch.zeros(LAYERS, tb, K, dtype=torch.int32, device=dev)
                ws = torch.zeros(LAYERS, tb, K, dtype=torch.float32, device=dev)
                outs = torch.zeros_like(xs)

                def body(tb=tb, xs=xs, ids=ids, ws=ws, outs=outs) -> None:
                    word.copy_in()
                    errors.zero_()
                    for i in range(LAYERS):
                        req.x[:tb].copy_(xs[i])
                        req.ids[:tb].copy_(ids[i])
                        req.w[:tb].copy_(ws[i])
                        link.signal(req.flag, word.step, i)
                        link.wait(ans.flag, word.step, i, abort, errors, 10.0)
                        outs[i].copy_(ans.out[:tb])
                        errors.bitwise_or_(ans.status)

                graph = None
                for _ in range(3):  # eagerly first (every kernel loaded), then captured and replayed
                    x = torch.randn(LAYERS, tb, H, generator=gen).to(DT)
                    i_ = torch.randint(0, 16, (LAYERS, tb, K), generator=gen, dtype=torch.int32)
                    i_[:, real:] = -1  # the bucket's padding rows
                    w = torch.rand(LAYERS, tb, K, generator=gen)
                    xs.copy_(x)
                    ids.copy_(i_)
                    ws.copy_(w)
                    torch.cuda.synchronize(dev)
                    worker = compute.run_step(step, tb, LAYERS)
                    assert co.step(step, tb, LAYERS) == ""
                    word.set(step, tb)
                    with torch.cuda.stream(stream):
                        if graph is None:
                            body()
                        else:
                            graph.replay()
                    word.replayed()
                    stream.synchronize()
                    worker.join(10)
                    assert not compute.errors, compute.errors
                    assert int(errors) == 0, f"step {step}: error bits {int(errors)}"
                    want = torch.stack([expected(x[i], i_[i], w[i]) for i in range(LAYERS)])
                    torch.testing.assert_close(outs.cpu(), want, rtol=0, atol=0)
                    step += 1
                    if graph is None:
                        graph = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(graph, stream=stream):
                            body()
            assert co.wait_idle(5) and co.stats().layers == 2 * 3 * LAYERS and co.stats().dropped == 0
        finally:
            torch.cuda.synchronize(dev)
            mapped.close()
