"""MoE LoRA on the coordinator: PEFT adapter loading and validation, the adapter registry,
LoRA on the coordinator's projections, per-token adapter slots for the routed experts, and the
service that validates an adapter and pushes it to every expert server.

May import: ``expertmesh``, ``coordinator.model`` and ``coordinator.experts``.
"""

from __future__ import annotations

from coordinator.lora.adapter import LoRAAdapter, load_adapter
from coordinator.lora.config import AdapterConfig, AdapterError
from coordinator.lora.manager import LoRADispatcher, LoRAManager

__all__ = ["AdapterConfig", "AdapterError", "LoRAAdapter", "LoRADispatcher", "LoRAManager", "load_adapter"]


def enable_lora(engine, max_loras: int = 4) -> LoRAManager:
    """Gives an :class:`~coordinator.model.engine.Engine` a LoRA manager with ``max_loras`` slots."""
    from coordinator.model.dispatch import LocalDispatcher

    manager = LoRAManager(engine.config, max_loras, engine.dtype, engine.device)
    manager.local_experts = isinstance(engine.dispatcher, LocalDispatcher)
    manager.attach(engine.model)
    engine.lora = manager
    return manager
