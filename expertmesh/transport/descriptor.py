"""Fixed-size descriptors: what crosses the process boundary per request on a fast path.

A request descriptor names where the payload of one ``Forward`` request sits (hidden states,
the routing block of slot ids + weights, the room for the answer) and its shapes; a response
descriptor carries the sequence number, a status code and, on error, a message. Both are
:data:`SIZE` bytes, written whole into a FIFO (atomic below PIPE_BUF), and end in a CRC-32.
Anything that does not parse, or points outside the rings, is rejected with a message saying
what is wrong; the expert server answers it with INVALID_ARGUMENT.

Shapes: T tokens, H hidden, K top-k. The routing block is ``[2, T, K]`` 32-bit words: slot ids
(int32) then weights (float32), followed, when the request carries MoE-LoRA adapter slots
(:data:`FLAG_ADAPTERS`), by ``[T]`` int32 adapter slots.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import torch

SIZE = 256
VERSION = 1
ALIGN = 64  # every payload offset; enough for any dtype view
FLAG_GPU = 1  # hidden in the coordinator's GPU ring, output in the server's GPU ring
FLAG_ADAPTERS = 2  # the routing block ends with [T] int32 adapter slots
FLAGS = FLAG_GPU | FLAG_ADAPTERS

REQUEST_MAGIC, RESPONSE_MAGIC, KICK_MAGIC = b"EMRQ", b"EMRS", b"EMKI"
LINK_STEP_MAGIC = b"EMLS"  # a device-link decode step (expertmesh/transport/link.py)
DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)  # code = index + 1

_REQ = struct.Struct("<4sHHQQiIIIBB2xQQQ")
_RESP = struct.Struct("<4sHHQfH")
# magic, version, seq, step, rows, bucket, generation, timeout_ms, micro-batches (0 from a sender
# that predates them: the sealed body's padding; read as 1)
_LINK = struct.Struct("<4sH2xQQIIQII")
MAX_MICRO = 8  # micro-batches of one linked step (the coordinator's --micro-batches range)
_CRC = struct.Struct("<I")
_BODY = SIZE - _CRC.size
MAX_MESSAGE = _BODY - _RESP.size
KICK = KICK_MAGIC + bytes(SIZE - len(KICK_MAGIC))


class DescriptorError(ValueError):
    """A descriptor that is truncated, corrupted or points outside the shared rings."""


def dtype_code(dtype: torch.dtype) -> int:
    return DTYPES.index(dtype) + 1


def _dtype(code: int, what: str) -> torch.dtype:
    if not 1 <= code <= len(DTYPES):
        raise DescriptorError(f"{what}: unknown dtype code {code}")
    return DTYPES[code - 1]


def _seal(body: bytes) -> bytes:
    body = body.ljust(_BODY, b"\0")
    return body + _CRC.pack(zlib.crc32(body))


def _open(raw: bytes | bytearray, magic: bytes) -> bytes:
    if len(raw) != SIZE:
        raise DescriptorError(f"truncated descriptor: {len(raw)} bytes, expected {SIZE}")
    if raw[:4] != magic:
        raise DescriptorError(f"bad descriptor magic {raw[:4]!r}, expected {magic!r}")
    body = bytes(raw[:_BODY])
    if zlib.crc32(body) != _CRC.unpack_from(raw, _BODY)[0]:
        raise DescriptorError("descriptor checksum mismatch (corrupted descriptor)")
    return body


def route_nbytes(tokens: int, top_k: int, adapters: bool = False) -> int:
    return 2 * tokens * top_k * 4 + (tokens * 4 if adapters else 0)


@dataclass(frozen=True)
class Request:
    seq: int
    generation: int
    layer: int
    tokens: int  # T
    hidden: int  # H
    top_k: int  # K
    hidden_dtype: torch.dtype
    out_dtype: torch.dtype
    hidden_off: int  # [T, H] in the host ring, or the coordinator's GPU ring (FLAG_GPU)
    route_off: int  # [2, T, K] in the host ring
    out_off: int  # [T, H] in the host ring, or the server's GPU ring (FLAG_GPU)
    flags: int = 0

    @property
    def on_gpu(self) -> bool:
        return bool(self.flags & FLAG_GPU)

    @property
    def has_adapters(self) -> bool:
        return bool(self.flags & FLAG_ADAPTERS)

    @property
    def hidden_nbytes(self) -> int:
        return self.tokens * self.hidden * self.hidden_dtype.itemsize

    @property
    def out_nbytes(self) -> int:
        return self.tokens * self.hidden * self.out_dtype.itemsize

    def pack(self) -> bytes:
        return _seal(
            _REQ.pack(
                REQUEST_MAGIC,
                VERSION,
                self.flags,
                self.seq,
                self.generation,
                self.layer,
                self.tokens,
                self.hidden,
                self.top_k,
                dtype_code(self.hidden_dtype),
                dtype_code(self.out_dtype),
                self.hidden_off,
                self.route_off,
                self.out_off,
            )
        )

    @classmethod
    def parse(cls, raw: bytes | bytearray, host_bytes: int, gpu_bytes: int) -> Request:
        """Parses and bounds-checks against the host ring and (FLAG_GPU) the GPU rings."""
        body = _open(raw, REQUEST_MAGIC)
        magic, version, flags, seq, gen, layer, t, h, k, hd, od, h_off, r_off, o_off = _REQ.unpack_from(body)
        if version != VERSION:
            raise DescriptorError(f"descriptor version {version}, this server speaks {VERSION}")
        if flags & ~FLAGS:
            raise DescriptorError(f"unknown descriptor flags {flags:#x}")
        if flags & FLAG_GPU and not gpu_bytes:
            raise DescriptorError("descriptor points into a GPU ring, but this channel has none")
        if h == 0 or k == 0:
            raise DescriptorError(f"descriptor with hidden size {h} and top-k {k}")
        req = cls(
            seq, gen, layer, t, h, k, _dtype(hd, "hidden"), _dtype(od, "output"), h_off, r_off, o_off, flags
        )
        big = gpu_bytes if req.on_gpu else host_bytes
        for what, off, n, cap in (
            ("hidden", h_off, req.hidden_nbytes, big),
            ("routing block", r_off, route_nbytes(t, k, req.has_adapters), host_bytes),
            ("output", o_off, req.out_nbytes, big),
        ):
            if off % ALIGN or off + n > cap:
                raise DescriptorError(
                    f"{what} [{off}, {off + n}) lies outside the {cap}-byte ring or is not {ALIGN}-byte aligned"
                )
        return req


@dataclass(frozen=True)
class Response:
    seq: int
    code: int = 0  # status number (expertmesh.errors, the gRPC numbering); 0 = OK
    compute_ms: float = 0.0
    message: str = ""

    def pack(self) -> bytes:
        msg = self.message.encode()[:MAX_MESSAGE]
        return _seal(
            _RESP.pack(RESPONSE_MAGIC, VERSION, self.code, self.seq, self.compute_ms, len(msg)) + msg
        )

    @classmethod
    def parse(cls, raw: bytes | bytearray) -> Response:
        body = _open(raw, RESPONSE_MAGIC)
        _, version, code, seq, ms, n = _RESP.unpack_from(body)
        if version != VERSION or n > MAX_MESSAGE:
            raise DescriptorError(f"response descriptor version {version}, message length {n}")
        msg = body[_RESP.size : _RESP.size + n].decode(errors="replace")
        return cls(seq, code, ms, msg)


def is_kick(raw: bytes) -> bool:
    return raw[:4] == KICK_MAGIC


@dataclass(frozen=True)
class LinkStep:
    """One decode step over the device link (expertmesh/transport/link.py): the server replays
    its step graph for ``bucket`` rows (``rows`` of them real) and placement ``generation``,
    whose waits give up after ``timeout_ms``. Answered by a :class:`Response`: code 0 once the
    graph is launched (not finished); anything else refuses the link for this step."""

    seq: int
    step: int
    rows: int  # b: the step's batch; rows >= b carry slot id -1
    bucket: int  # Tb: the graphs' padded batch
    generation: int
    timeout_ms: int
    # > 1: a micro-batched step over a relayed link (expertmesh/transport/relay.c): ``bucket /
    # micro`` rows a micro-batch, each MoE layer ``micro`` requests in a row (layer ``i`` of
    # micro-batch ``m`` is request ``i * micro + m``)
    micro: int = 1

    def pack(self) -> bytes:
        return _seal(
            _LINK.pack(
                LINK_STEP_MAGIC,
                VERSION,
                self.seq,
                self.step,
                self.rows,
                self.bucket,
                self.generation,
                self.timeout_ms,
                self.micro,
            )
        )

    @classmethod
    def parse(cls, raw: bytes | bytearray) -> LinkStep:
        body = _open(raw, LINK_STEP_MAGIC)
        _, version, seq, step, rows, bucket, gen, timeout_ms, micro = _LINK.unpack_from(body)
        if version != VERSION:
            raise DescriptorError(f"descriptor version {version}, this server speaks {VERSION}")
        if not 0 < rows <= bucket:
            raise DescriptorError(f"link step with {rows} rows in a bucket of {bucket}")
        if step >= 2**52:  # NOTE: step * STEP_SPAN + index must stay an int64
            raise DescriptorError(f"link step number {step} out of range")
        micro = micro or 1
        if micro > MAX_MICRO or bucket % micro:
            raise DescriptorError(
                f"link step of {micro} micro-batches in a bucket of {bucket} (1..{MAX_MICRO}, dividing it)"
            )
        return cls(seq, step, rows, bucket, gen, timeout_ms, micro)


def is_link_step(raw: bytes | bytearray) -> bool:
    return raw[:4] == LINK_STEP_MAGIC
