"""Where the routed experts of an MoE layer get computed.

The model calls ``dispatcher.submit(layer, x, topk_ids, topk_weights)`` and gets back a
:class:`Pending` whose ``wait()`` returns the summed routed-expert output. Between the two the
model computes its shared expert, which overlaps with remote experts.

:class:`LocalDispatcher` computes every expert in process (slot = logical expert id).
The remote dispatcher (coordinator/experts/remote.py) splits the step across expert servers.

Shapes: T tokens, K top-k, H hidden, E experts, I expert intermediate size.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import torch

from coordinator.model.cpu_moe import CPUExpertBackend
from expertmesh.checkpoint import CheckpointReader
from expertmesh.config import ModelConfig
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
    read_experts_into(reader, layer, experts, w13, w2, pool)
    return w13, w2


def read_experts_into(
    reader: CheckpointReader,
    layer: int,
    experts: list[int],
    w13: torch.Tensor,  # [S, 2I, H]
    w2: torch.Tensor,  # [S, H, I]
    pool: ThreadPoolExecutor | None = None,
) -> None:
    """Reads ``experts`` of ``layer`` into the slots of ``w13``, ``w2`` (slot s = experts[s])."""
    i = reader.config.moe_intermediate_size

    def read(s: int, e: int) -> Callable[[], None]:
        return lambda: reader.expert_into(layer, e, w13[s, :i], w13[s, i:], w2[s])

    run_on(pool, [read(s, e) for s, e in enumerate(experts)])


class BackgroundLoad:
    """A load running on a thread of its own (LocalDispatcher's experts), so that the engine
    compiles its kernels meanwhile: on a fresh machine the decode graphs' first warm-up compiles
    every Triton kernel and builds its launcher (~8 s at Qwen3-30B-A3B widths on an H200 host,
    next to ~7 s reading 58 GB of experts). :meth:`wait` ends it (raising its error);
    :meth:`early` marks the calls that may run on weights still arriving."""

    def __init__(self, name: str, target: Callable[[], None]) -> None:
        self.allowed_early = False
        self._error: BaseException | None = None

        def run() -> None:
            try:
                target()
            except BaseException as e:  # noqa: BLE001  # NOTE: raised in the waiting thread
                self._error = e

        self._thread = threading.Thread(target=run, name=name, daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def wait(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error

    @contextmanager
    def early(self) -> Iterator[None]:
        """Calls in this block may read weights not loaded yet (a compile warm-up: its results
        are thrown away; the slots start as zeros, so nothing reads a NaN)."""
        self.allowed_early = True
        try:
            yield
        finally:
            self.allowed_early = False


def _expert_slots(
    cfg: ModelConfig, dtype: torch.dtype, device: torch.device, new: Callable[..., torch.Tensor]
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Every MoE layer's stacked [E, 2I, H] gate/up and [E, H, I] down weights, made by ``new``."""
    h, i, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    return {
        layer: (new(e, 2 * i, h, dtype=dtype, device=device), new(e, h, i, dtype=dtype, device=device))
        for layer in cfg.moe_layer_ids
    }


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
        background: bool = False,
    ) -> None:
        """``background``: return once every slot is allocated (zeros), with the experts read on
        a thread of their own (:attr:`load`); :meth:`submit` waits for them, except inside
        ``load.early()``, and :meth:`wait_loaded` raises a failed read."""
        cfg = reader.config
        e = cfg.num_experts
        self.backend = backend or default_backend(device)
        self.slots = _expert_slots(cfg, dtype, device, torch.zeros if background else torch.empty)
        self.load: BackgroundLoad | None = None

        def read_all() -> None:
            total = reader.expert_nbytes() * e * len(cfg.moe_layer_ids)
            reader.progress = LoadProgress("coordinator experts", total)
            try:
                with reader_pool(read_threads()) as pool:
                    for layer, (w13, w2) in self.slots.items():
                        read_experts_into(reader, layer, list(range(e)), w13, w2, pool)
            finally:
                reader.progress.close()
                reader.progress = None

        if background:
            self.load = BackgroundLoad("expert-load", read_all)
        else:
            read_all()

    @classmethod
    def zeros(cls, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> LocalDispatcher:
        """Every slot zeros and nothing read: the experts of a compile warm-up
        (coordinator/model/compile_ahead.py), shaped as a loaded dispatcher's."""
        self = cls.__new__(cls)
        self.backend = default_backend(device)
        self.slots = _expert_slots(cfg, dtype, device, torch.zeros)
        self.load = None
        return self

    def wait_loaded(self) -> None:
        """Returns once every expert is read (at once without a background load)."""
        if self.load is not None:
            self.load.wait()
            self.load = None

    def submit(self, layer, x, topk_ids, topk_weights):
        if self.load is not None and not self.load.allowed_early:
            self.wait_loaded()
        w13, w2 = self.slots[layer]
        return Pending.done(self.backend.forward(x, w13, w2, topk_ids, topk_weights))
