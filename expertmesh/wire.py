"""Tensors on the wire: raw little-endian bytes + dtype name + shape (``expertmesh.v1.Tensor``),
and the gRPC codec of the ExpertWorker API's plain types (:mod:`expertmesh.worker_api`):
``ExpertRequest`` <-> ``ForwardRequest``, ``WorkerInfo`` <-> ``DescribeResponse``.

Protobuf messages only, no gRPC: the servicer and the coordinator's connection call these.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from expertmesh.errors import InvalidRequest
from expertmesh.v1 import expert_worker_pb2 as pb
from expertmesh.v1 import tensor_pb2
from expertmesh.worker_api import ExpertRequest, WorkerInfo

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int32": torch.int32,
    "int64": torch.int64,
}
NAMES = {v: k for k, v in DTYPES.items()}


class WireError(InvalidRequest, ValueError):
    """A tensor message that cannot be decoded (unknown dtype, size/shape mismatch)."""


def dtype_name(dtype: torch.dtype) -> str:
    return NAMES[dtype]


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise WireError(f"unknown dtype {name!r}; expected one of {sorted(DTYPES)}") from None


def encode(t: torch.Tensor) -> tensor_pb2.Tensor:
    t = t.detach().contiguous()
    if t.device.type != "cpu":
        t = t.cpu()
    raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return tensor_pb2.Tensor(dtype=dtype_name(t.dtype), shape=list(t.shape), data=raw)


MAX_DIMS = 8
# NOTE: a bound on every dimension and on the product of the non-zero ones: torch computes the
# storage size of an EMPTY tensor from all dimensions too ([2**62, 2**62, 0] overflows it)
MAX_DIM = 1 << 31
MAX_ELEMENTS = 1 << 40


def decode(msg: tensor_pb2.Tensor, what: str = "tensor") -> torch.Tensor:
    """Decodes without copying where possible; the result is read-only memory (clone to write).
    Raises :class:`WireError` for anything that does not describe a tensor of ``data``'s bytes."""
    dtype = parse_dtype(msg.dtype) if msg.dtype else None
    if dtype is None:
        raise WireError(f"{what}: missing dtype")
    shape = check_shape(msg.shape, what)
    numel = 1
    for s in shape:
        numel *= s
    itemsize = torch.empty((), dtype=dtype).element_size()
    if len(msg.data) != numel * itemsize:
        raise WireError(
            f"{what}: {len(msg.data)} bytes do not match shape {list(shape)} of {msg.dtype} "
            f"({numel * itemsize} bytes expected)"
        )
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    flat = torch.frombuffer(bytearray(msg.data), dtype=torch.uint8)
    return flat.view(dtype).view(shape)


def check_shape(dims: Sequence[int], what: str = "tensor") -> tuple[int, ...]:
    """``dims`` as a shape torch can allocate, or :class:`WireError` (negative, too many or too
    large dimensions: the element count is checked with the zero dimensions left out)."""
    if len(dims) > MAX_DIMS:
        raise WireError(f"{what}: {len(dims)} dimensions, at most {MAX_DIMS}")
    shape = tuple(int(s) for s in dims)
    if any(s < 0 for s in shape):
        raise WireError(f"{what}: negative dimension in shape {_clip(shape)}")
    if any(s > MAX_DIM for s in shape):
        raise WireError(f"{what}: dimension above {MAX_DIM} in shape {_clip(shape)}")
    nonzero = 1
    for s in shape:
        nonzero *= max(s, 1)
    if nonzero > MAX_ELEMENTS:
        raise WireError(f"{what}: shape {_clip(shape)} has more than {MAX_ELEMENTS} elements")
    return shape


def _clip(shape: tuple[int, ...]) -> list[int] | str:
    return list(shape) if len(shape) <= MAX_DIMS else f"{list(shape[:MAX_DIMS])}... ({len(shape)} dims)"


# ---------------------------------------------------------------- ExpertWorker messages


def encode_request(req: ExpertRequest, dtype: torch.dtype) -> pb.ForwardRequest:
    """``req`` as a ``ForwardRequest``, hidden states gathered and cast to the server's ``dtype``."""
    msg = pb.ForwardRequest(
        seq=req.seq,
        generation=req.generation,
        layer=req.layer,
        hidden=encode(req.gathered().to(dtype)),
        slot_ids=encode(req.slot_ids),
        weights=encode(req.weights),
    )
    if req.adapter_slots is not None:
        msg.adapter_slots.CopyFrom(encode(req.adapter_slots))
    return msg


def decode_request(msg: pb.ForwardRequest) -> ExpertRequest:
    """Raises :class:`WireError` (an InvalidRequest) for a tensor that does not decode; the
    worker core checks shapes and values."""
    adapters = decode(msg.adapter_slots, "adapter_slots") if msg.HasField("adapter_slots") else None
    return ExpertRequest(
        seq=msg.seq,
        generation=msg.generation,
        layer=msg.layer,
        hidden=decode(msg.hidden, "hidden"),
        slot_ids=decode(msg.slot_ids, "slot_ids"),
        weights=decode(msg.weights, "weights"),
        adapter_slots=adapters,
    )


def encode_info(info: WorkerInfo) -> pb.DescribeResponse:
    return pb.DescribeResponse(
        kind=info.kind,
        device=info.device,
        dtype=dtype_name(info.dtype),
        backend=info.backend,
        model_type=info.model_type,
        hidden_size=info.hidden_size,
        num_experts=info.num_experts,
        moe_layers=list(info.moe_layers),
        slot_capacity=info.slot_capacity,
        host_id=info.host_id,
        fast_paths=list(info.fast_paths),
        generation=info.generation,
        device_uuid=info.device_uuid,
        max_message_bytes=info.max_message_bytes,
        weight_dtype=info.weight_dtype,
        weight_bytes=info.weight_bytes,
        peak_weight_bytes=info.peak_weight_bytes,
        process_rss_bytes=info.process_rss_bytes,
        process_peak_rss_bytes=info.process_peak_rss_bytes,
        device_allocated_bytes=info.device_allocated_bytes,
        device_peak_allocated_bytes=info.device_peak_allocated_bytes,
    )


def decode_info(msg: pb.DescribeResponse) -> WorkerInfo:
    return WorkerInfo(
        kind=msg.kind,
        device=msg.device,
        dtype=parse_dtype(msg.dtype),
        backend=msg.backend,
        model_type=msg.model_type,
        hidden_size=msg.hidden_size,
        num_experts=msg.num_experts,
        moe_layers=tuple(msg.moe_layers),
        slot_capacity=msg.slot_capacity,
        host_id=msg.host_id,
        fast_paths=tuple(msg.fast_paths),
        generation=msg.generation,
        device_uuid=msg.device_uuid,
        max_message_bytes=msg.max_message_bytes,
        weight_dtype=msg.weight_dtype,
        weight_bytes=msg.weight_bytes,
        peak_weight_bytes=msg.peak_weight_bytes,
        process_rss_bytes=msg.process_rss_bytes,
        process_peak_rss_bytes=msg.process_peak_rss_bytes,
        device_allocated_bytes=msg.device_allocated_bytes,
        device_peak_allocated_bytes=msg.device_peak_allocated_bytes,
    )
