"""The in-process engine: model + KV cache + page tables, one forward step at a time.

It knows nothing of requests or sampling: the scheduler (or a test) says which sequences get
which new tokens in a step, and it returns their logits. Routed experts go through whatever
dispatcher is attached (in process by default, expert servers in the cluster).

Shapes: T tokens in the step, V vocab.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from coordinator.model.batch import ForwardBatch
from coordinator.model.cuda_graphs import DecodeGraphs
from coordinator.model.dispatch import Dispatcher, LocalDispatcher
from coordinator.model.kv_cache import KVCache, KVCacheSpec, OutOfPages, PageAllocator
from coordinator.model.loader import load_model
from coordinator.model.models.base import CausalLM
from coordinator.model.models.moe import LoadHook
from expertmesh.checkpoint import CheckpointReader

if TYPE_CHECKING:
    from coordinator.lora.manager import LoRAManager


@dataclass
class SeqState:
    cached: int = 0  # tokens whose K/V are in the cache
    pages: list[int] = field(default_factory=list)


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
    ) -> None:
        """``cuda_graphs``: on CUDA with every expert in process, capture the decode step's
        graphs now (coordinator/model/cuda_graphs.py); ignored elsewhere."""
        self.model, self.dispatcher, self.dtype, self.device = model, dispatcher, dtype, device
        self.config = model.config
        model.attach(dispatcher, load_hook)
        self.cache = KVCache(model.config, spec, dtype, device)
        self.pages = PageAllocator(spec.num_pages)
        self.seqs: dict[int, SeqState] = {}
        self._next_id = 0
        self.graphs: DecodeGraphs | None = None
        mode = dispatcher.graph_mode if cuda_graphs and device.type == "cuda" else "none"
        if mode == "whole":
            self.graphs = DecodeGraphs(model, self.cache, spec.num_pages, load_hook)
        elif mode == "piecewise":
            # NOTE: remote dispatch waits on another process inside the layer loop: the step is
            # captured in pieces between the dispatches (coordinator/model/remote_graphs.py)
            from coordinator.model.remote_graphs import RemoteDecodeGraphs

            self.graphs = RemoteDecodeGraphs(model, self.cache, spec.num_pages, load_hook, dispatcher)  # type: ignore[arg-type]

        # called after every forward step on the step's thread (the EPLB manager's counter)
        self.after_step: Callable[[], None] | None = None

        # MoE LoRA (coordinator/lora): set by enable_lora; None = adapters refused
        self.lora: LoRAManager | None = None

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
    ) -> Engine:
        reader = CheckpointReader(path)
        dev = torch.device(device)
        model = load_model(reader, dtype, dev)
        dispatcher = dispatcher or LocalDispatcher(reader, dtype, dev)
        return cls(model, dispatcher, KVCacheSpec(num_pages, page_size), dtype, dev, cuda_graphs=cuda_graphs)

    @property
    def page_size(self) -> int:
        return self.cache.page_size

    def pages_needed(self, seq_id: int, new_tokens: int) -> int:
        s = self.seqs[seq_id]
        total = s.cached + new_tokens
        return max(0, -(-total // self.page_size) - len(s.pages))

    def new_seq(self) -> int:
        self._next_id += 1
        self.seqs[self._next_id] = SeqState()
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
        token_adapter = None
        if self.lora is not None:
            names = adapters if adapters is not None else [None] * len(items)
            token_adapter = self.lora.token_slots(names, [len(t) for _, t in items])
        elif adapters is not None and any(a is not None for a in adapters):
            raise KeyError("LoRA adapters are not enabled on this engine")
        need = sum(self.pages_needed(sid, len(toks)) for sid, toks in items)
        if need > self.pages.num_free:
            raise OutOfPages(f"step needs {need} new pages, {self.pages.num_free} free")
        for sid, toks in items:
            self.seqs[sid].pages.extend(self.pages.alloc(self.pages_needed(sid, len(toks))))
        # NOTE: captured decode graphs hold the base model only: a step with an adapter runs eagerly
        uses_lora = adapters is not None and any(a is not None for a in adapters)
        decode = not all_logits and not uses_lora and all(len(toks) == 1 for _, toks in items)
        if self.lora is not None:
            self.lora.begin_step(token_adapter if uses_lora else None)
        if decode and self.graphs is not None and self.graphs.bucket(len(items)) is not None:
            self.dispatcher.begin_step(len(items))
            logits = self.graphs.run(
                [(toks[0], self.seqs[sid].cached, self.seqs[sid].pages) for sid, toks in items]
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
        if self.after_step is not None:
            self.after_step()
        if not all_logits:
            return list(logits.unbind(0))
        return list(logits.split([len(t) for _, t in items]))
