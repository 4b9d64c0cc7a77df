"""The pieces of a linked decode step (coordinator/model/remote_graphs.py): one graph per step
whose MoE layers hand over to an expert server through a link's request and answer areas
(expertmesh/transport/link.py), the device link's in peer GPU memory or a host link's in host
memory mapped into our GPU (expertmesh/transport/host_map.py), with the in-process member's
share computed inside the same graph (a hybrid step).

Shapes: Bm largest bucket, H hidden, K top-k, E experts, L_moe MoE layers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from coordinator.model.dispatch import Dispatcher, Pending

if TYPE_CHECKING:
    from expertmesh.transport.client import LinkAreas
    from expertmesh.transport.link import StepWord

log = logging.getLogger("expertmesh.remote")


@dataclass
class LinkedStep:
    """One bucket's whole decode step over a link, as one graph."""

    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # [bucket, V] static output
    # (layer, [rows, K] routing ids, first row) for the load hook: a micro-batched step has one
    # per layer and micro-batch
    ids: list[tuple[int, torch.Tensor, int]]
    # [L_moe, bucket, K] every layer's ids, stacked by the graph (whole steps with a step hook)
    stacked: torch.Tensor | None = None


@dataclass
class LocalShare:
    """The in-process member's share of a hybrid linked step (coordinator/experts/local.py):
    its Triton backend, its slot table (the dispatcher's ``link_local_table``) and the live
    generation's weights per MoE layer, whose addresses the graphs hold."""

    inner: Any  # gpu_server/backend.py TritonExpertBackend
    table: torch.Tensor  # [L_moe, E] int32: the local slot of each expert, -1 elsewhere
    weights: list[tuple[torch.Tensor, torch.Tensor]]  # per MoE layer (w13 [S, 2I, H], w2 [S, H, I])
    key: tuple  # (generation, the weights' addresses): new -> the graphs are captured again


@dataclass
class LinkState:
    """What the linked graphs of one link share: the link, the areas as our device addresses
    them (the link's own for a device link; mapped host memory for a host link), its step
    word, the abort and error words (ours), the padding mask, the graphs' own pool and each
    bucket's step."""

    link: LinkAreas
    req: Any  # link.RequestViews on our device
    ans: Any  # link.AnswerViews on our device
    step: StepWord
    abort: torch.Tensor  # [1] int64
    errors: torch.Tensor  # [1] int64: ERR_* bits of the step (zeroed by the graph)
    rowid: torch.Tensor  # [Bm, 1] int64
    pad: torch.Tensor  # [Bm, 1] bool: rows >= b of the step (computed by the graph)
    pool: Any = None  # the graphs' own memory pool (torch.cuda.graph_pool_handle)
    steps: dict[tuple[int, int], LinkedStep] = field(default_factory=dict)  # (bucket, micro) ->
    mapped: Any = None  # host link: the HostMapped areas (unregistered when the link goes)
    _scratch: Any = None  # a request area of our own, what a capture's warm-up run writes
    local_key: tuple | None = None  # the LocalShare.key the graphs in ``steps`` were captured with

    @classmethod
    def new(cls, lnk: LinkAreas, device: torch.device, bm: int) -> LinkState:
        from expertmesh.transport import link  # NOTE: Triton: CUDA coordinators only

        assert lnk.ans is not None
        req, ans, mapped = lnk.req, lnk.ans, None
        if lnk.host:
            req, ans, mapped = map_host_areas(lnk, device)
            # NOTE: the channel's close() unpins the pages before it unmaps them (a later
            # segment at the same address could not be pinned while they stay registered)
            lnk.mapped = mapped
        st = cls(
            lnk,
            req,
            ans,
            link.StepWord(device),
            torch.zeros(1, dtype=torch.int64, device=device),
            torch.zeros(1, dtype=torch.int64, device=device),
            torch.arange(bm, device=device).view(bm, 1),
            torch.zeros(bm, 1, dtype=torch.bool, device=device),
            torch.cuda.graph_pool_handle(),
            mapped=mapped,
        )
        # a dead channel ends a step in flight at once instead of at its timeout (ShmClient.kill)
        lnk.cancel = link.Canceller(st.abort)
        return st

    def scratch(self) -> Any:
        """A request area like the link's, in our own memory (link.RequestViews)."""
        if self._scratch is None:
            from expertmesh.transport import link

            lnk = self.link
            r, h, k, dt = lnk.rows, lnk.hidden, lnk.top_k, lnk.dtype
            area = link.new_area(link.request_bytes(r, h, k, dt), self.abort.device)
            self._scratch = link.RequestViews.of(area, r, h, k, dt)
        return self._scratch

    def close(self) -> None:
        """Drops the graphs and unmaps a host link's areas (the caller holds no replay)."""
        self.steps.clear()
        if self.mapped is not None:
            from expertmesh.transport.cuda_ipc import CudaIpcError

            try:
                self.mapped.close()
            except CudaIpcError as e:  # the segment may be gone already: nothing reads it now
                log.info("host link areas: %s", e)
            self.mapped = None


def map_host_areas(lnk: LinkAreas, device: torch.device) -> tuple[Any, Any, Any]:
    """A host link's request and answer areas (shared memory, request first) as views on our
    device: one registration over both, so that the graph writes and polls them over PCIe."""
    from expertmesh.transport import cuda_ipc, link
    from expertmesh.transport.host_map import HostMapped

    assert lnk.ans is not None
    r, h, k, dt = lnk.rows, lnk.hidden, lnk.top_k, lnk.dtype
    start, ans_at = lnk.area.data_ptr(), lnk.ans.flag.data_ptr()
    end = ans_at + link.answer_bytes(r, h, dt)
    if not start < ans_at or ans_at - start < link.request_bytes(r, h, k, dt):
        raise RuntimeError("the host link's answer area does not follow its request area")
    span = cuda_ipc.wrap(start, end - start, torch.device("cpu"))  # [end - start] uint8, no copy
    mapped = HostMapped(span, device)
    dev = mapped.tensor
    req = link.RequestViews.of(dev, r, h, k, dt)
    ans = link.AnswerViews.of(dev[ans_at - start :], r, h, dt)
    return req, ans, mapped


class Linker(Dispatcher):
    """Stands in for the remote dispatcher while a bucket's linked step is captured: submit
    fills the request area and signals, the Pending's wait waits for the answer and copies it.

    ``micro`` > 1 (a relayed link that takes them): the step is captured as micro-batches of
    ``bucket / micro`` rows (CausalLM.forward_micro), each in its own rows of the areas; the
    k-th submit of the step is request ``k`` (layer ``k // micro`` of micro-batch ``k % micro``),
    and its wait takes a flag at or past its own (relay.c publishes answers as they come)."""

    def __init__(
        self,
        st: LinkState,
        table: torch.Tensor,
        moe_index: dict[int, int],
        bucket: int,
        timeout_s: float,
        local: LocalShare | None = None,
        micro: int = 1,
    ):
        assert micro == 1 or (local is None and bucket % micro == 0), f"{micro=} {bucket=}"
        self.st, self.table, self.moe_index = st, table, moe_index  # table: [L_moe, E] int32
        self.bucket, self.timeout_s, self.local = bucket, timeout_s, local
        self.micro, self.rows = micro, bucket // micro  # rows: of one micro-batch
        self.capturing = False  # False: the warm-up run (every op once, no flag kernel)
        self.ids: list[tuple[int, torch.Tensor, int]] = []  # (layer, [rows, K] ids, first row)
        self._k = 0  # the step's submits so far

    def prologue(self) -> None:
        """The step's first nodes: zero errors, the padding mask (of the (step, rows) word the
        host uploads before each replay, StepWord.upload)."""
        st = self.st
        st.errors.zero_()
        torch.ge(st.rowid, st.step.rows, out=st.pad)
        self._k = 0

    def submit(self, layer, x, topk_ids, topk_weights):
        from expertmesh.transport import link

        st, i, k = self.st, self.moe_index[layer], self._k
        self._k += 1
        index, at = (i, 0) if self.micro == 1 else (k, (k % self.micro) * self.rows)
        assert self.micro == 1 or k // self.micro == i, f"request {k} of layer {i}: out of order"
        rows = slice(at, at + self.rows)  # this micro-batch's (the whole bucket's if not split)
        req, ans = st.req, st.ans
        step = st.step.step
        # the request (x; the server's slot of each (token, k), -1 for padding and local experts;
        # the weights) and its flag in one kernel. NOTE: the warm-up run writes a private copy
        # of the area: its flag would announce a step the server never saw
        into = req if self.capturing else st.scratch()
        link.send(into, rows, x.contiguous(), topk_ids.contiguous(), topk_weights.contiguous(),
                  self.table[i], st.step.dev, index)  # fmt: skip
        if self.capturing:
            self.ids.append((layer, topk_ids, at))
        mine = self._local_share(i, x, topk_ids, topk_weights)  # runs while the server computes

        def wait() -> torch.Tensor:  # [rows, H]
            if self.capturing:
                link.wait(ans.flag, step, index, st.abort, st.errors, self.timeout_s, at_least=self.micro > 1)
            # NOTE: a copy into our memory now: the server reuses its area for the next layer
            return link.take(ans, rows, st.errors, x.dtype, mine)

        return Pending(wait)

    def _local_share(self, i: int, x, topk_ids, topk_weights) -> torch.Tensor | None:
        """The in-process member's experts of MoE layer ``i`` (``[tb, H]``), queued after the
        server's request went out; None when the server holds every expert."""
        if self.local is None:
            return None
        from gpu_server.link_graphs import moe_into  # NOTE: Triton: CUDA coordinators only

        tb = self.bucket
        ids = torch.index_select(self.local.table[i], 0, topk_ids.reshape(-1)).view(tb, -1)
        ids.masked_fill_(self.st.pad[:tb], -1)  # [tb, K] int32: -1 for the server's and padding
        w13, w2 = self.local.weights[i]
        out = torch.empty_like(x)  # [tb, H]
        moe_into(self.local.inner, x, w13, w2, ids, topk_weights.to(torch.float32), out)
        return out
