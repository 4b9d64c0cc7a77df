"""Tensor decoding refuses every shape/byte/dtype combination that does not describe its payload
with a WireError (INVALID_ARGUMENT), before torch is asked to allocate anything."""

from __future__ import annotations

import pytest
import torch

from expertmesh import wire
from expertmesh.v1 import tensor_pb2 as tpb

BAD = [
    ("float32", [2**62, 2**62, 0], b"", "dimension above"),  # torch: "Storage size calculation overflowed"
    ("float32", [2**31, 2**31, 0], b"", "more than"),
    ("float32", [0, 2**40], b"", "dimension above"),
    ("float32", [-1, 4], b"", "negative dimension"),
    ("float32", [1] * 9, b"\0" * 4, "dimensions, at most"),
    ("float32", [1] * 100000, b"", "dimensions, at most"),
    ("float32", [2, 3], b"\0" * 23, "bytes do not match"),
    ("float32", [2**20, 2**20], b"\0" * 4, "bytes do not match"),
    ("complex64", [1], b"\0" * 8, "unknown dtype"),
    ("", [1], b"\0" * 4, "missing dtype"),
]


@pytest.mark.parametrize(("dtype", "shape", "data", "msg"), BAD)
def test_bad_tensor_is_a_wire_error(dtype, shape, data, msg):
    with pytest.raises(wire.WireError, match=msg):
        wire.decode(tpb.Tensor(dtype=dtype, shape=shape, data=data), "hidden")


def test_empty_tensors_with_large_zero_shapes_decode():
    t = wire.decode(tpb.Tensor(dtype="float32", shape=[0, 1 << 20], data=b""))
    assert t.shape == (0, 1 << 20)


def test_round_trip_of_every_dtype():
    for dtype in wire.DTYPES.values():
        x = (torch.arange(24) - 5).to(dtype).reshape(2, 3, 4)
        torch.testing.assert_close(wire.decode(wire.encode(x)), x)
