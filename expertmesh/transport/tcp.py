"""The TCP data path: per-layer ``Forward`` traffic as binary frames on a plain socket, for
expert servers on other hosts (where no shared memory reaches).

Frames reuse the shared-memory descriptors (:mod:`.descriptor`), with offsets that point into
the frame's own body instead of a ring:

- request: a :class:`~.descriptor.Request` (256 bytes, CRC-sealed) then its body, the hidden
  states ``[T, H]`` at ``hidden_off`` (0) and the routing block ``[2, T, K]`` (+ ``[T]``
  adapter slots) at ``route_off``; the body is ``route_off + route bytes`` long.
- response: a :class:`~.descriptor.Response` then, when its code is 0, the output ``[T, H]``
  (the dtype and rows of the request, which the coordinator remembers).

Tensors travel in the server's compute dtype (bf16 for a bf16 model), raw; both sides read
and write them in place in buffers allocated once per connection (no protobuf, no allocation
per layer). The server answers a connection's requests in order.

Setting up (on the gRPC ``Forward`` stream, like the shared-memory path; gRPC stays the
control plane and the fallback): the coordinator's Hello names ``tcp``, a fresh 128-bit
stream token and its buffer size; the server (which checks the cluster token in the stream's
metadata, if it has one) answers with the port of its data listener and whether it speaks
TLS there. The coordinator then connects, sends :data:`PREAMBLE` (magic + the stream token),
and the server answers :data:`ACCEPTED` once the token matched a stream waiting for it. The
token is single-use and only ever crosses the gRPC channel (TLS when TLS is configured), so
only the coordinator that opened the stream can attach to it.

TLS: a server with ``--tls-cert`` serves its data port with TLS too (the same certificate; a
client certificate signed by ``--tls-ca`` required when it has one), and the coordinator
wraps its socket with its own ``--tls-*`` settings, as for gRPC.

Address: the coordinator reaches the data port at the host of the server's gRPC address, or
at ``--server-data-address SERVER=HOST:PORT`` when something (a NAT, the loopback latency
proxy of :mod:`.delay_proxy`) sits in between.

Shapes: T tokens, H hidden, K top-k.
"""

from __future__ import annotations

import socket
import ssl
import struct

import torch

from expertmesh.tls import TLSConfig
from expertmesh.transport import descriptor as dsc
from expertmesh.transport.layout import aligned

PREAMBLE = struct.Struct("<8s16s")  # magic, the stream token
PREAMBLE_MAGIC = b"EMTCP1\0\0"
ACCEPTED = b"EMTCPOK\0"
HEADER = dsc.SIZE
# a request sent while others are still unanswered must fit the kernel's socket buffers: the
# server answers one request while the coordinator sends the next, and neither reads while it
# writes (bigger ones go over gRPC, whose flow control then applies)
PIPELINED_MAX_BYTES = 64 << 10
CONNECT_TIMEOUT_S = 10.0


class TcpError(OSError):
    """The data connection could not be set up, or broke."""


def body_layout(tokens: int, hidden: int, top_k: int, dtype: torch.dtype, adapters: bool) -> tuple[int, int]:
    """(route_off, body bytes) of a request frame: hidden at 0, the routing block after it."""
    route_off = aligned(tokens * hidden * dtype.itemsize)
    return route_off, route_off + dsc.route_nbytes(tokens, top_k, adapters)


def tune(sock: socket.socket) -> None:
    """No Nagle delay: a frame goes out as soon as it is written."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def recv_into(sock: socket.socket, view: memoryview) -> int:
    """Fills ``view`` from ``sock``; returns the bytes read (fewer only at end of stream)."""
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            return got
        got += k
    return got


def server_context(tls: TLSConfig | None) -> ssl.SSLContext | None:
    """The data listener's TLS context (None: plaintext): the gRPC port's certificate, and
    client certificates required when a CA is configured (as on the gRPC port)."""
    if tls is None or not tls.server_enabled:
        return None
    assert tls.cert is not None and tls.key is not None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(tls.cert, tls.key)
    if tls.ca:
        ctx.load_verify_locations(tls.ca)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_context(tls: TLSConfig | None) -> ssl.SSLContext | None:
    """The coordinator's TLS context for a data port (None: no TLS configured): verifies the
    server against ``--tls-ca`` (else the system's roots), presents ``--tls-cert``."""
    if tls is None or not tls.client_enabled:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=tls.ca)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if tls.cert and tls.key:
        ctx.load_cert_chain(tls.cert, tls.key)
    return ctx


def split_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` / ``[V6]:PORT`` -> (host, port); ValueError says what is wrong."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{address!r} is not HOST:PORT")
    return host.strip("[]"), int(port)
