"""The in-process engine: model + KV cache + page tables, one forward step at a time.

It knows nothing of requests or sampling: the scheduler (or a test) says which sequences get
which new tokens in a step, and it returns their logits. Routed experts go through whatever
dispatcher is attached (in process by default, expert servers in the cluster).

With the prefix cache on (the default), every page a step fills completely enters the prefix
index (coordinator/model/prefix_cache.py) and stays there after its sequence ends, until the
allocator needs the room; :meth:`Engine.new_seq` given a prompt starts the sequence on the
longest indexed prefix of it, shared by reference. Only whole pages are shared and a sequence
writes only past its shared pages, so a shared page is never written again (a step that fails
and runs again rewrites the sequence's own pages only).

Shapes: T tokens in the step, V vocab.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from coordinator.model.batch import ForwardBatch
from coordinator.model.cuda_graphs import DecodeGraphs, Replayed
from coordinator.model.dispatch import Dispatcher, LocalDispatcher
from coordinator.model.kv_cache import KVCache, KVCacheSpec, OutOfPages, PageAllocator
from coordinator.model.loader import load_model
from coordinator.model.models.base import CausalLM
from coordinator.model.models.moe import LoadHook, StepLoadHook
from coordinator.model.prefix_cache import Block, PrefixIndex, Salt
from expertmesh.checkpoint import CheckpointReader

if TYPE_CHECKING:
    from coordinator.lora.manager import LoRAManager


@dataclass
class SeqState:
    cached: int = 0  # tokens whose K/V are in the cache
    pages: list[int] = field(default_factory=list)
    # prefix cache only: the cached tokens, the KV salt (adapter), the last of the sequence's
    # first ``indexed`` pages, all in the index; False once a page could not be added
    tokens: list[int] = field(default_factory=list)
    salt: Salt = None
    chain: Block | None = None
    indexed: int = 0
    indexing: bool = True


class Engine:
    def __init__(
        self,
        model: CausalLM,
        dispatcher: Dispatcher,
        spec: KVCacheSpec,
        dtype: torch.dtype,
        device: torch.device,
        load_hook: LoadHook | None = None,
        cuda_graphs: bool = True,
        prefix_cache: bool = True,
        step_load: StepLoadHook | None = None,
    ) -> None:
        """``cuda_graphs``: on CUDA with every expert in process, capture the decode step's
        graphs now (coordinator/model/cuda_graphs.py); ignored elsewhere. ``prefix_cache``:
        keep full pages indexed for later sequences with the same prefix. ``step_load``: where the
        decode graphs count a replayed step's routing in one call (else ``load_hook`` per layer)."""
        self.model, self.dispatcher, self.dtype, self.device = model, dispatcher, dtype, device
        self.config = model.config
        model.attach(dispatcher, load_hook)
        self.cache = KVCache(model.config, spec, dtype, device)
        self.pages = PageAllocator(spec.num_pages)
        self.prefix = PrefixIndex(spec.page_size, self.pages) if prefix_cache else None
        self.seqs: dict[int, SeqState] = {}
        self._next_id = 0
        self.graphs: DecodeGraphs | None = None
        mode = dispatcher.graph_mode if cuda_graphs and device.type == "cuda" else "none"
        if mode == "whole":
            load = getattr(dispatcher, "load", None)  # experts still being read: compile meanwhile
            self.graphs = DecodeGraphs(
                model, self.cache, spec.num_pages, load_hook, load=load, step_load=step_load
            )
        elif mode == "piecewise":
            # NOTE: remote dispatch waits on another process inside the layer loop: the step is
            # captured in pieces between the dispatches (coordinator/model/remote_graphs.py)
            from coordinator.model.remote_graphs import RemoteDecodeGraphs

            self.graphs = RemoteDecodeGraphs(
                model,
                self.cache,
                spec.num_pages,
                load_hook,
                dispatcher,  # type: ignore[arg-type]
                step_load=step_load,
            )

        self._micro_batches: int | None = 1

        # called after every forward step on the step's thread (the EPLB manager's counter)
        self.after_step: Callable[[], None] | None = None

        # MoE LoRA (coordinator/lora): set by enable_lora; None = adapters refused
        self.lora: LoRAManager | None = None

    @property
    def micro_batches(self) -> int | None:
        """A decode step of 2+ sequences runs as up to this many micro-batches of whole
        sequences (CausalLM.forward_micro: eagerly, or inside the linked decode graph where the
        link takes them, coordinator/model/remote_graphs.py); 1 = off; None = the measured
        default (remote_graphs.auto_micro: inside linked steps only, never eagerly)."""
        return self._micro_batches

    @micro_batches.setter
    def micro_batches(self, n: int | None) -> None:
        self._micro_batches = n
        if self.graphs is not None and hasattr(self.graphs, "micro"):
            self.graphs.micro = n

    @classmethod
    def from_checkpoint(
        cls,
        path: str,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        dispatcher: Dispatcher | None = None,
        num_pages: int = 256,
        page_size: int = 16,
        cuda_graphs: bool = True,
        prefix_cache: bool = True,
    ) -> Engine:
        reader = CheckpointReader(path)
        dev = torch.device(device)
        model = load_model(reader, dtype, dev)
        dispatcher = dispatcher or LocalDispatcher(reader, dtype, dev)
        spec = KVCacheSpec(num_pages, page_size)
        return cls(model, dispatcher, spec, dtype, dev, cuda_graphs=cuda_graphs, prefix_cache=prefix_cache)

    @property
    def page_size(self) -> int:
        return self.cache.page_size

    def pages_needed(self, seq_id: int, new_tokens: int) -> int:
        s = self.seqs[seq_id]
        total = s.cached + new_tokens
        return max(0, -(-total // self.page_size) - len(s.pages))

    def _salt(self, adapter: str | None) -> Salt:
        """What besides the tokens sets their K/V: the adapter and the load that installed it
        (an adapter unloaded and loaded again under its name gets a new salt)."""
        if adapter is None:
            return None
        return (adapter, self.lora.load_ids.get(adapter) if self.lora is not None else None)

    def _match(self, tokens: Sequence[int], salt: Salt) -> list[Block]:
        if self.prefix is None or not tokens:
            return []
        # NOTE: at least the last token is computed (its logits are the point); its page must not
        # be a shared one, so a prompt of whole pages recomputes its last page
        return self.prefix.match(tokens, salt, (len(tokens) - 1) // self.page_size)

    def prefix_hit(self, tokens: Sequence[int], adapter: str | None = None) -> tuple[int, int]:
        """(pages of ``tokens`` that :meth:`new_seq` would share, how many of those are kept
        pages now, i.e. counted in ``pages.num_free`` until shared). Changes nothing."""
        blocks = self._match(tokens, self._salt(adapter))
        return len(blocks), sum(1 for b in blocks if self.pages.refs(b.page) == 0)

    def new_seq(self, tokens: Sequence[int] = (), adapter: str | None = None) -> int:
        """A new sequence for ``tokens`` under LoRA ``adapter`` (None = base model): it starts
        with the longest indexed prefix of ``tokens`` cached (``seqs[id].cached`` tokens, shared
        pages), the rest for the caller to step. Without tokens it starts empty."""
        salt = self._salt(adapter)
        blocks = self._match(tokens, salt)
        pages = [b.page for b in blocks]
        self.pages.share(pages)
        n = len(pages) * self.page_size
        state = SeqState(n, pages, list(tokens[:n]), salt, blocks[-1] if blocks else None, len(blocks))
        self._next_id += 1
        self.seqs[self._next_id] = state
        return self._next_id

    def free(self, seq_id: int) -> None:
        s = self.seqs.pop(seq_id, None)
        if s is not None:
            self.pages.free(s.pages)

    def step(
        self,
        items: list[tuple[int, list[int]]],
        all_logits: bool = False,
        adapters: list[str | None] | None = None,
    ) -> list[torch.Tensor]:
        """Runs one forward step. items: (seq id, new token ids). Returns logits per item:
        ``[V]`` for its last token, or ``[n, V]`` for each new token when ``all_logits``.
        ``adapters``: the LoRA adapter name of each item (None = base model).

        Raises OutOfPages (before touching any state) when the cache cannot hold the step.
        """
        # unknown adapters raise KeyError here, before any state changes
        uses_lora = adapters is not None and any(a is not None for a in adapters)
        token_adapter = None
        if uses_lora:
            if self.lora is None:
                raise KeyError("LoRA adapters are not enabled on this engine")
            assert adapters is not None
            # NOTE: only for a step with an adapter: the slots are a host-to-device copy
            # (~0.3 ms a step at full size) that a base-model step never reads
            token_adapter = self.lora.token_slots(adapters, [len(t) for _, t in items])
        self._take_pages([(sid, len(toks)) for sid, toks in items])
        # NOTE: captured decode graphs hold the base model only: a step with an adapter runs eagerly
        decode = not all_logits and not uses_lora and all(len(toks) == 1 for _, toks in items)
        if self.lora is not None:
            self.lora.begin_step(token_adapter)
        # NOTE: the default (None) never splits eagerly: eager micro-batches double the Python
        # per layer and paid in no measured run
        n = min(self.micro_batches or 1, len(items))
        split = decode and n >= 2 and not uses_lora and not _defers(self.dispatcher)
        begun = False  # begin_step once a step (it may wait for servers and switch tables)
        if split and self.graphs is not None and hasattr(self.graphs, "links"):
            # NOTE: a step that can go over the link replays the linked graph, which splits it
            # into micro-batches itself where the link takes them: eager micro-batches cost
            # Python per layer that the graph does not
            self.dispatcher.begin_step(len(items))
            begun = True
            split = not self.graphs.links(len(items))
        if split:
            groups = [items[j * len(items) // n : (j + 1) * len(items) // n] for j in range(n)]
            batches = [
                ForwardBatch.build(
                    [(toks, self.seqs[sid].cached, self.seqs[sid].pages) for sid, toks in g],
                    self.page_size,
                    self.device,
                )
                for g in groups
            ]
            if not begun:
                self.dispatcher.begin_step(len(items))
            logits = self.model.forward_micro(batches, self.cache)  # [B, V]
        elif decode and self.graphs is not None and self.graphs.bucket(len(items)) is not None:
            if not begun:
                self.dispatcher.begin_step(len(items))
            logits = self.graphs.run(
                [(toks[0], self.seqs[sid].cached, self.seqs[sid].pages) for sid, toks in items]
            )
        elif (
            not all_logits
            and not uses_lora
            and self.graphs is not None
            and self.graphs.extends
            and self.graphs.bucket(sum(len(toks) for _, toks in items)) is not None
        ):
            # a short prefill or a cached prefix's extend: one replay, not an eager step
            self.dispatcher.begin_step(sum(len(toks) for _, toks in items))
            logits = self.graphs.run_tokens(
                [(toks, self.seqs[sid].cached, self.seqs[sid].pages) for sid, toks in items]
            )
        else:
            batch = ForwardBatch.build(
                [(toks, self.seqs[sid].cached, self.seqs[sid].pages) for sid, toks in items],
                self.page_size,
                self.device,
                all_logits=all_logits,
            )
            self.dispatcher.begin_step(batch.num_tokens)
            logits = self.model(batch, self.cache)  # [B', V]
        for sid, toks in items:
            self.seqs[sid].cached += len(toks)
        if self.prefix is not None:
            salts = [self._salt(a) for a in adapters] if adapters is not None else [None] * len(items)
            for (sid, toks), salt in zip(items, salts):
                self._index(self.seqs[sid], toks, salt)
        if self.after_step is not None:
            self.after_step()
        if not all_logits:
            return list(logits.unbind(0))
        return list(logits.split([len(t) for _, t in items]))

    def _take_pages(self, items: list[tuple[int, int]]) -> None:
        """Pages for (seq id, new tokens) of a step; OutOfPages (nothing taken) when they do
        not fit."""
        need = sum(self.pages_needed(sid, n) for sid, n in items)
        if need > self.pages.num_free:
            raise OutOfPages(f"step needs {need} new pages, {self.pages.num_free} free")
        for sid, n in items:
            s = self.seqs[sid]
            s.pages.extend(self.pages.alloc(self.pages_needed(sid, n)))
            # the step writes rows cached.. on: never into an indexed (shareable) page
            assert not self.pages.indexed(s.pages[s.cached // self.page_size]), (
                f"seq {sid} writes a shared page"
            )

    def launches(self, b: int) -> bool:
        """Whether :meth:`launch` queues a decode step of ``b`` sequences without waiting for it
        (a captured graph takes it); else it runs the step there and then."""
        g = self.graphs
        # NOTE: not a step the engine would split into eager micro-batches (--micro-batches)
        return (
            g is not None
            and g.bucket(b) is not None
            and (min(self.micro_batches or 1, b) < 2 or _defers(self.dispatcher))
        )

    def launch(self, items: list[tuple[int, int]], feed: torch.Tensor | None = None) -> Launched:
        """A base-model decode step of (seq id, new token id) items, queued on the device and
        not waited for where a decode graph takes it (:meth:`launches`): the scheduler samples
        it on the device and queues the next step behind it before the host reads a token.
        ``feed`` ``[b]`` int64 on the model's device: the step's token ids in place of the
        items' (the last step's samples, not on the host yet). Raises OutOfPages as
        :meth:`step`. The step's tokens enter the prefix index only once it is finished."""
        b = len(items)
        if not self.launches(b):  # the step runs now (eager, or micro-batched)
            toks = feed.tolist() if feed is not None else [t for _, t in items]
            rows = self.step([(sid, [t]) for (sid, _), t in zip(items, toks, strict=True)])
            return Launched(self, [sid for sid, _ in items], Replayed(torch.stack(rows)), indexed=True)
        assert self.graphs is not None
        self._take_pages([(sid, 1) for sid, _ in items])
        if self.lora is not None:
            self.lora.begin_step(None)
        self.dispatcher.begin_step(b)
        step = self.graphs.launch(
            [(tok, self.seqs[sid].cached, self.seqs[sid].pages) for sid, tok in items], feed
        )
        for sid, _ in items:
            self.seqs[sid].cached += 1
        if self.after_step is not None:
            self.after_step()
        return Launched(self, [sid for sid, _ in items], step, indexed=False)

    def _index(self, s: SeqState, toks: list[int], salt: Salt) -> None:
        """After a step wrote ``toks`` for ``s``: its pages now full enter the prefix index."""
        assert self.prefix is not None
        if salt != s.salt:  # stepped under another adapter than it was started with
            s.indexing = False
        if not s.indexing:
            return
        s.tokens.extend(toks)
        p = self.page_size
        # NOTE: ``cached`` may run ahead of the tokens known here (a launched step's)
        while s.indexing and (s.indexed + 1) * p <= min(s.cached, len(s.tokens)):
            i = s.indexed
            toks_i = s.tokens[i * p : (i + 1) * p]
            blk = self.prefix.add(s.chain, salt, toks_i, s.pages[i])
            if blk is None:
                # the same block is indexed on another page already: the sequence takes that
                # page in place of its own copy (freed) and goes on indexing after it, so its
                # later pages (a reply, the next chat turn) are found too. NOTE: only the page
                # table of later steps changes; a step still queued reads the old page, which
                # anything reallocating it writes only after that step, on the same stream
                blk = self.prefix.find(s.chain, salt, toks_i)
                if blk is None:
                    s.indexing = False
                    break
                own = s.pages[i]
                self.pages.share([blk.page])
                s.pages[i] = blk.page
                self.pages.free([own])
            s.chain, s.indexed = blk, i + 1


class Launched:
    """A decode step :meth:`Engine.launch` queued: ``logits`` ``[b, V]`` on the model's device
    (valid until the engine's next step). Call :meth:`finish` once it is no longer wanted or
    once its results are (for a linked step it waits for the step's end, whose error word it
    reads; anything else it answers at once)."""

    def __init__(self, engine: Engine, seqs: list[int], step: Replayed, indexed: bool) -> None:
        self.engine, self.seqs, self.step, self.indexed = engine, seqs, step, indexed
        self.logits = step.logits

    def finish(self, tokens: list[int | None] | None = None) -> bool:
        """Whether the step's results hold (False: a linked step that failed, nothing of it
        used). ``tokens``: its input ids (a fed step's, known to the host by now; None for a
        sequence not to index), which then enter the prefix index: their K/V are written by
        the step, or by the time any later step on the stream reads them."""
        ok = self.step.finish()
        eng = self.engine
        if ok and not self.indexed and eng.prefix is not None and tokens is not None:
            self.indexed = True
            for sid, tok in zip(self.seqs, tokens, strict=True):
                s = eng.seqs.get(sid)
                if s is not None and tok is not None:
                    eng._index(s, [tok], None)
        return ok

    def cancel(self) -> None:
        """Ends its waits on a server at once (its results will not be used)."""
        if self.step.cancel is not None:
            self.step.cancel()

    def undo(self) -> None:
        """Its sequences' K/V positions go back: a step of no use (a failed one, or one fed
        with its tokens), whose writes the step run again in its place rewrites. Only a graph
        step can fail after its launch; a step run eagerly (indexed when it ran) is never
        undone but where the scheduler's loop ends anyway."""
        for sid in self.seqs:
            s = self.engine.seqs.get(sid)
            if s is not None:
                s.cached -= 1


def _defers(dispatcher: Dispatcher) -> bool:
    """Whether the dispatcher holds CPU experts back a layer (--cpu-defer-experts): one held
    sum per layer, so those steps are never split into micro-batches."""
    cluster = getattr(dispatcher, "cluster", None)
    return bool(getattr(cluster, "cpu_defer_experts", 0))
