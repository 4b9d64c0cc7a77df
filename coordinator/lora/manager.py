"""The coordinator's adapter registry and its LoRA on the coordinator's own projections.

An adapter loaded here gets an adapter slot (0..max_loras-1). Each forward step, the engine
says which slot every token uses (``begin_step(token_adapter [T])``, -1 = base); projection
hooks add ``B (A x)`` to the outputs of the tokens of each slot, and the LoRA dispatcher hands
the same per-token slots to the routed-expert computation.

NOTE: the per-step slots live on the manager, which the hooks close over, because the layers
do not receive the batch; the engine sets them before every forward and nothing else does.

Shapes: T tokens in the step, R rank, L adapter slots.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch import nn

from coordinator.lora.adapter import LoRAAdapter, Projection, ProjectionLoRA, load_adapter, projection_table
from coordinator.lora.config import AdapterError
from coordinator.model.dispatch import Dispatcher, LocalDispatcher, Pending
from coordinator.model.models.base import CausalLM
from coordinator.model.models.mla import MLAttention
from expertmesh.config import ModelConfig
from expertmesh.lora import LoRABatch, MoELoRAWeights, lora_delta


class LoRAManager:
    def __init__(
        self, model_cfg: ModelConfig, max_loras: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        assert max_loras > 0, f"{max_loras=}"
        self.model_cfg, self.max_loras, self.dtype, self.device = model_cfg, max_loras, dtype, device
        self.table: dict[str, Projection] = projection_table(model_cfg)
        self.adapters: dict[str, LoRAAdapter] = {}
        self.slot_of: dict[str, int] = {}
        # name -> which install it is: the prefix cache keys an adapter's KV pages by it, so a
        # name unloaded and loaded again (other weights) never meets the old pages
        self.load_ids: dict[str, int] = {}
        self._installs = itertools.count()
        # module path -> adapter slot -> its LoRA (on device, in the model dtype)
        self.proj: dict[str, dict[int, ProjectionLoRA]] = {}
        self.experts: dict[int, MoELoRAWeights] = {}  # MoE layer -> stacked slots (in-process path)
        self.token_adapter: torch.Tensor | None = None  # [T] for the current step
        self._hooked: set[str] = set()
        # routed-expert LoRA computed here (in-process experts); False when expert servers hold it
        self.local_experts = True
        self._model: CausalLM | None = None

    # ---------------------------------------------------------------- registry

    def load(self, name: str, path: str) -> LoRAAdapter:
        """Reads, validates and installs an adapter (fully, or not at all)."""
        if name in self.adapters:
            raise AdapterError(f"adapter {name!r} is already loaded")
        free = sorted(set(range(self.max_loras)) - set(self.slot_of.values()))
        if not free:
            raise AdapterError(f"all {self.max_loras} adapter slots are in use (--max-loras)")
        adapter = load_adapter(name, path, self.model_cfg, self.table)
        self.install(adapter, free[0])
        return adapter

    def install(self, adapter: LoRAAdapter, slot: int) -> None:
        self.adapters[adapter.name] = adapter
        self.slot_of[adapter.name] = slot
        self.load_ids[adapter.name] = next(self._installs)
        for mod, p in adapter.projections.items():
            self.proj.setdefault(mod, {})[slot] = ProjectionLoRA(
                p.a.to(self.device, self.dtype), p.b.to(self.device, self.dtype)
            )
            self._hook(mod)
        self._restack()

    def unload(self, name: str) -> None:
        if name not in self.adapters:
            raise KeyError(name)
        slot = self.slot_of.pop(name)
        del self.load_ids[name]
        del self.adapters[name]
        for per_slot in self.proj.values():
            per_slot.pop(slot, None)
        self._restack()

    def _restack(self) -> None:
        """Rebuilds the in-process expert buffers [max_loras, E, R, ...] from the resident adapters."""
        self.experts = {}
        if not self.local_experts:
            return
        cfg = self.model_cfg
        for layer in cfg.moe_layer_ids:
            loras = {
                self.slot_of[n]: a.experts[layer] for n, a in self.adapters.items() if layer in a.experts
            }
            if not loras:
                continue
            r13 = max(lo.ranks[0] for lo in loras.values())
            r2 = max(lo.ranks[1] for lo in loras.values())
            buf = MoELoRAWeights.zeros(
                self.max_loras,
                cfg.num_experts,
                cfg.hidden_size,
                cfg.moe_intermediate_size,
                r13,
                r2,
                self.dtype,
                self.device,
            )
            for slot, lo in loras.items():
                buf.put(slot, lo.to(self.device, self.dtype))
            self.experts[layer] = buf

    def token_slots(self, names: Sequence[str | None], lengths: Sequence[int]) -> torch.Tensor:
        """Per-token adapter slot [T] for sequences named ``names`` with ``lengths`` new tokens."""
        slots: list[int] = []
        for name, n in zip(names, lengths):
            if name is not None and name not in self.slot_of:
                raise KeyError(name)
            slots.extend([-1 if name is None else self.slot_of[name]] * n)
        return torch.tensor(slots, dtype=torch.long, device=self.device)

    # ---------------------------------------------------------------- forward

    def begin_step(self, token_adapter: torch.Tensor | None) -> None:
        self.token_adapter = (
            token_adapter if token_adapter is not None and bool((token_adapter >= 0).any()) else None
        )

    def attach(self, model: CausalLM) -> None:
        """Hooks the model's MoE blocks (routed-expert LoRA) and projections (on demand)."""
        self._model = model
        for mod in list(self.proj):
            self._hook(mod)
        for block in model.moe_blocks():
            assert block.dispatcher is not None, "attach the base dispatcher first"
            if not isinstance(block.dispatcher, LoRADispatcher):
                block.dispatcher = LoRADispatcher(block.dispatcher, self)

    def _hook(self, module_path: str) -> None:
        if self._model is None or module_path in self._hooked:
            return
        module = self._model.get_submodule(module_path)
        parent_path, _, leaf = module_path.rpartition(".")
        parent = self._model.get_submodule(parent_path)
        if leaf == "kv_b_proj" and isinstance(parent, MLAttention):
            # NOTE: MLA absorbs kv_b_proj into its attention and never runs it as a
            # layer, so it reads the step's LoRA of it itself
            parent.kv_b_lora = lambda: self._step_lora(module_path)
        else:
            module.register_forward_hook(self._projection_hook(module_path))
        self._hooked.add(module_path)

    def _step_lora(self, path: str) -> tuple[torch.Tensor, dict[int, ProjectionLoRA]] | None:
        """(token slots [T], slot -> LoRA) of this step for one projection; None when none applies."""
        slots, per_slot = self.token_adapter, self.proj.get(path)
        return None if slots is None or not per_slot else (slots, per_slot)

    def _projection_hook(self, path: str):
        def hook(module: nn.Module, args: tuple, output):
            slots = self.token_adapter
            per_slot = self.proj.get(path)
            if slots is None or not per_slot:
                return None
            x = args[0]  # [T, in]
            merged = isinstance(output, list)
            y = torch.cat(output, dim=-1) if merged else output  # [T, out]
            y = y.clone()
            for slot, p in per_slot.items():
                rows = torch.where(slots == slot)[0]
                if rows.numel():
                    y[rows] += lora_delta(x[rows], p.a, p.b)
            if merged:
                return list(y.split([o.shape[-1] for o in output], dim=-1))
            return y

        return hook

    def expert_lora(self, layer: int) -> tuple[MoELoRAWeights | None, torch.Tensor | None]:
        if self.token_adapter is None:
            return None, None
        return self.experts.get(layer), self.token_adapter


class LoRADispatcher(Dispatcher):
    """Wraps the in-process dispatcher: routed experts with the step's per-token adapters."""

    def __init__(self, inner: Dispatcher, manager: LoRAManager) -> None:
        self.inner, self.manager = inner, manager

    def submit(self, layer, x, topk_ids, topk_weights):
        weights, slots = self.manager.expert_lora(layer)
        if not isinstance(self.inner, LocalDispatcher):
            # expert servers hold the adapters (pushed at load): send each token's adapter slot
            a = self.manager.token_adapter
            return self.inner.submit(layer, x, topk_ids, topk_weights, adapter_slots=a)  # type: ignore[call-arg]
        if weights is None or slots is None:
            return self.inner.submit(layer, x, topk_ids, topk_weights)
        w13, w2 = self.inner.slots[layer]
        lora = LoRABatch(weights, slots)
        return Pending.done(self.inner.backend.forward(x, w13, w2, topk_ids, topk_weights, lora))

    def begin_step(self, num_tokens: int) -> None:
        self.inner.begin_step(num_tokens)

    def take_deferred(self) -> Pending | None:  # --cpu-defer-experts
        return self.inner.take_deferred()

    def close(self) -> None:
        self.inner.close()
