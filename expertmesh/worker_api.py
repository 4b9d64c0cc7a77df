"""The ExpertWorker API as plain types (no gRPC, no protobuf): what the coordinator's dispatcher
sends to an expert server and what the server says about itself.

:class:`ExpertRequest` is the one shape of "one MoE layer's routed work for one server". The
dispatcher builds it (coordinator/experts/remote.py), each transport encodes and decodes exactly this
type (gRPC: :func:`expertmesh.wire.encode_request` / :func:`~expertmesh.wire.decode_request`;
shared memory: :meth:`expertmesh.transport.client.ShmClient.send` /
``expertmesh.transport.server.ShmServer._decode``), and the worker core
(:class:`expertmesh.worker.core.ExpertWorker`) checks and computes it. A new field touches this
type, those two codecs and its consumer in the worker core, nothing else (``adapter_slots`` is
the example: carried and validated end to end, not used by compute yet).

Shapes: T tokens of this request, T_all tokens of the step, H hidden, K top-k.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExpertRequest:
    seq: int  # matches the answer to the request on a pipelined stream
    generation: int  # placement generation the slot ids refer to
    layer: int
    hidden: torch.Tensor  # [T, H], or [T_all, H] with ``rows`` (coordinator side, not yet gathered)
    slot_ids: torch.Tensor  # [T, K] int32 local slots, -1 = the expert lives elsewhere
    weights: torch.Tensor  # [T, K] float32 routing weights
    adapter_slots: torch.Tensor | None = None  # [T] int32 MoE-LoRA adapter slot, -1 = none
    rows: torch.Tensor | None = None  # [T] rows of ``hidden`` this request covers; None = all

    @property
    def tokens(self) -> int:
        return int(self.slot_ids.shape[0])

    @property
    def top_k(self) -> int:
        return int(self.slot_ids.shape[1])

    def gathered(self) -> torch.Tensor:
        """``[T, H]``: the hidden states of this request's rows."""
        if self.rows is None:
            return self.hidden
        if self.rows.numel() == self.hidden.shape[0]:  # every row, in order (rows are sorted)
            return self.hidden
        return self.hidden.index_select(0, self.rows.to(self.hidden.device))


@dataclass(frozen=True)
class WorkerInfo:
    """What ``Describe`` reports: enough for the coordinator to check compatibility, size the
    placement and negotiate a data path."""

    kind: str  # "gpu" | "cpu"
    device: str
    dtype: torch.dtype
    backend: str
    model_type: str
    hidden_size: int
    num_experts: int
    moe_layers: tuple[int, ...]
    slot_capacity: int
    host_id: str
    fast_paths: tuple[str, ...]
    generation: int  # the live placement generation
    device_uuid: str = ""
    max_message_bytes: int = 0
    # routed experts as resident: stored dtype ("float8_e4m3fn" under FP8) and bytes
    weight_dtype: str = ""
    weight_bytes: int = 0
    # memory (expertmesh/worker/memory.py): expert bytes' peak, the process's RSS, CUDA bytes
    peak_weight_bytes: int = 0
    process_rss_bytes: int = 0
    process_peak_rss_bytes: int = 0
    device_allocated_bytes: int = 0
    device_peak_allocated_bytes: int = 0
