"""The MoE block on the coordinator: router, load hook, dispatch, shared expert, merge.

Shapes: T tokens, H hidden, E experts, K top-k.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from coordinator.model.dispatch import Dispatcher
from coordinator.model.models.layers import GatedMLP, linear
from coordinator.model.router import RouterSpec, route
from expertmesh.config import ModelConfig

# (layer, topk_ids [T, K]) -> None; the expert-load recorder (EPLB) plugs in here.
LoadHook = Callable[[int, torch.Tensor], None]
# ids [L_moe, T, K] of every MoE layer of one step, in order -> None: the same counts in one
# call, for the decode graphs (LoadRecorder.record_step)
StepLoadHook = Callable[[torch.Tensor], None]


class Gate(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size, dtype=dtype))
        self.e_score_correction_bias: nn.Parameter | None = (
            nn.Parameter(torch.empty(cfg.num_experts, dtype=torch.float32)) if cfg.correction_bias else None
        )


class MoEBlock(nn.Module):
    """Routed experts go to the dispatcher; the shared expert (if any) runs here meanwhile.

    ``shared_name`` is the checkpoint's attribute name of the shared expert
    (``shared_expert`` for Qwen2-MoE, ``shared_experts`` for DeepSeek). The shared expert runs
    between submit and wait, overlapping with remote experts.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        layer: int,
        dtype: torch.dtype,
        shared_name: str = "shared_expert",
        logits_fp32: bool = False,
    ) -> None:
        super().__init__()
        self.layer = layer
        self.spec = RouterSpec.from_config(cfg)
        self.gate = Gate(cfg, dtype)
        self.shared_name = shared_name
        self.logits_fp32 = logits_fp32  # DeepSeek's router multiplies in float32
        self.has_shared = bool(cfg.shared_expert_intermediate_size)
        if self.has_shared:
            setattr(self, shared_name, GatedMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size, dtype))
        self.shared_expert_gate = linear(cfg.hidden_size, 1, dtype) if cfg.shared_expert_gate else None
        # set by the model owner; not parameters
        self.dispatcher: Dispatcher | None = None
        self.load_hook: LoadHook | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [T, H]
        return self.start(x)()

    def start(self, x: torch.Tensor) -> Callable[[], torch.Tensor]:  # x [T, H]
        """Routes ``x`` and sends its routed experts; the returned call runs the shared expert,
        waits for the routed sum and returns the block's output ``[T, H]`` (micro-batched
        decode runs another micro-batch's attention in between)."""
        assert self.dispatcher is not None, "MoEBlock used before a dispatcher was attached"
        if self.logits_fp32:
            logits = F.linear(x.float(), self.gate.weight.float())  # [T, E]
        else:
            logits = F.linear(x, self.gate.weight)  # [T, E]
        topk_ids, topk_weights = route(logits, self.spec, self.gate.e_score_correction_bias)
        if self.load_hook is not None:
            self.load_hook(self.layer, topk_ids)
        pending = self.dispatcher.submit(self.layer, x, topk_ids, topk_weights)

        def finish() -> torch.Tensor:
            # NOTE: no getattr default: a missing module attribute costs a raised exception per layer
            shared_out = getattr(self, self.shared_name)(x) if self.has_shared else None
            if shared_out is not None and self.shared_expert_gate is not None:
                shared_out = torch.sigmoid(self.shared_expert_gate(x)) * shared_out
            routed = pending.wait()
            return routed if shared_out is None else routed + shared_out

        return finish
