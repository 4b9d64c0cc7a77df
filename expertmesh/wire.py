"""Tensors on the wire: raw little-endian bytes + dtype name + shape (``expertmesh.v1.Tensor``)."""

from __future__ import annotations

import torch

from expertmesh.v1 import tensor_pb2

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int32": torch.int32,
    "int64": torch.int64,
}
NAMES = {v: k for k, v in DTYPES.items()}


class WireError(ValueError):
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


def decode(msg: tensor_pb2.Tensor, what: str = "tensor") -> torch.Tensor:
    """Decodes without copying where possible; the result is read-only memory (clone to write)."""
    dtype = parse_dtype(msg.dtype) if msg.dtype else None
    if dtype is None:
        raise WireError(f"{what}: missing dtype")
    shape = tuple(int(s) for s in msg.shape)
    if any(s < 0 for s in shape):
        raise WireError(f"{what}: negative dimension in shape {list(shape)}")
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
