"""Where the routed experts of an MoE layer get computed.

The model calls ``dispatcher.submit(layer, x, topk_ids, topk_weights)`` and gets back a
:class:`Pending` whose ``wait()`` returns the summed routed-expert output. Between the two the
model computes its shared expert, which overlaps with remote experts.

:class:`LocalDispatcher` computes every expert in process (slot = logical expert id).
The remote dispatcher (coordinator/experts/remote.py) splits the step across expert servers.

Shapes: T tokens, K top-k, H hidden, E experts, I expert intermediate size.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from coordinator.model.cpu_moe import CPUExpertBackend
from expertmesh.checkpoint import CheckpointReader
from expertmesh.experts import ExpertBackend, TorchExpertBackend
from expertmesh.progress import LoadProgress
from expertmesh.safetensors_io import read_threads, reader_pool, run_on


class Pending:
    """The not-yet-awaited result of one MoE layer's routed experts."""

    def __init__(self, wait: Callable[[], torch.Tensor]) -> None:
        self._wait = wait

    def wait(self) -> torch.Tensor:  # [T, H]
        return self._wait()

    @staticmethod
    def done(value: torch.Tensor) -> Pending:
        return Pending(lambda: value)


class Dispatcher(ABC):
    # how a CUDA engine may graph the decode step around this dispatcher (coordinator/model/engine.py):
    # "whole" (every expert in process), "piecewise" (cut at each MoE dispatch), "none"
    graph_mode = "none"

    @abstractmethod
    def submit(
        self,
        layer: int,
        x: torch.Tensor,  # [T, H]
        topk_ids: torch.Tensor,  # [T, K] logical expert ids
        topk_weights: torch.Tensor,  # [T, K] float32
    ) -> Pending: ...

    def begin_step(self, num_tokens: int) -> None:  # noqa: B027 (optional hook)
        """Called once before each forward step (placement switches happen here)."""

    def close(self) -> None:  # noqa: B027 (optional hook)
        pass

    def take_deferred(self) -> Pending | None:
        """The deferred CPU-expert sum of the last submit, if any (coordinator/model/deferral.py)."""
        return None


def stack_experts(
    reader: CheckpointReader,
    layer: int,
    experts: list[int],
    dtype: torch.dtype,
    device: torch.device,
    pool: ThreadPoolExecutor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reads ``experts`` of ``layer`` into slot tensors ``w13 [S, 2I, H]``, ``w2 [S, H, I]``:
    each expert straight from the checkpoint into its slot, on ``pool``'s reader threads."""
    cfg = reader.config
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    w13 = torch.empty(len(experts), 2 * i, h, dtype=dtype, device=device)
    w2 = torch.empty(len(experts), h, i, dtype=dtype, device=device)

    def read(s: int, e: int) -> Callable[[], None]:
        return lambda: reader.expert_into(layer, e, w13[s, :i], w13[s, i:], w2[s])

    run_on(pool, [read(s, e) for s, e in enumerate(experts)])
    return w13, w2


def default_backend(device: torch.device) -> ExpertBackend:
    """The fused Triton kernels on CUDA (the GPU expert server's backend), plain torch with few
    ops per step on the CPU (coordinator/model/cpu_moe.py), the plain-torch reference elsewhere."""
    if device.type == "cuda":
        # NOTE: imported here so the CPU coordinator never loads Triton
        from gpu_server.backend import make_backend

        return make_backend(str(device))
    if device.type == "cpu":
        return CPUExpertBackend()
    return TorchExpertBackend()


class LocalDispatcher(Dispatcher):
    """All routed experts in this process: the in-process engine path and the reference."""

    graph_mode = "whole"

    def __init__(
        self,
        reader: CheckpointReader,
        dtype: torch.dtype,
        device: torch.device,
        backend: ExpertBackend | None = None,
    ) -> None:
        cfg = reader.config
        self.backend = backend or default_backend(device)
        all_experts = list(range(cfg.num_experts))
        total = reader.expert_nbytes() * cfg.num_experts * len(cfg.moe_layer_ids)
        reader.progress = LoadProgress("coordinator experts", total)
        try:
            with reader_pool(read_threads()) as pool:
                self.slots = {
                    layer: stack_experts(reader, layer, all_experts, dtype, device, pool)
                    for layer in cfg.moe_layer_ids
                }
        finally:
            reader.progress.close()
            reader.progress = None

    def submit(self, layer, x, topk_ids, topk_weights):
        w13, w2 = self.slots[layer]
        return Pending.done(self.backend.forward(x, w13, w2, topk_ids, topk_weights))
