"""The fast-path handshake: the first message of a ``Forward`` stream.

The coordinator sends ``ForwardRequest{seq: 0, fast_path: Hello}``; the server answers
``ForwardResponse{seq: 0, fast_path: Ack}`` with the transport it accepts (possibly a slower
one, with the reason) and then serves the stream: fast-path requests through the shared
segment (or the TCP data connection, :mod:`.tcp`), anything else (payloads too big for the
ring) as plain gRPC messages.

A ``tcp`` Hello names no segment: ``ring_bytes`` is the largest frame body the coordinator
will send, ``token`` the stream token it will present on the data connection; the Ack's
``tcp`` says where to connect (``{"port": P, "tls": bool}``).

A ``tcp`` Hello may offer a relayed link (expertmesh/transport/relay.py): ``relay`` names the
areas' shape, the MoE layers a step carries, the relay's timeout and a second stream token;
the server answers ``relay: {"accepted": true}`` or ``{"reason": why}``, and the coordinator
then opens a second connection to the data port with that token for the relay.

Hello and Ack are a magic prefix and a small JSON object; this runs once per stream, so
readability beats compactness. A message that does not parse is an INVALID_ARGUMENT.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from expertmesh import wire
from expertmesh.transport.cuda_ipc import SYNC_MODES
from expertmesh.transport.link_layout import host_areas
from expertmesh.transport.segment import is_segment_name

MAGIC = b"EMHS1"
TRANSPORTS = ("grpc", "tcp", "shm", "cuda_ipc")  # slowest to fastest
MAX_TCP_BUFFER = 1 << 30  # a tcp Hello's largest frame body
LINK_DTYPES = ("bfloat16", "float16", "float32")  # a host link's payload dtypes (wire names)


class HandshakeError(ValueError):
    pass


@dataclass(frozen=True)
class CudaHello:
    device_uuid: str
    in_ring: dict  # cuda_ipc.share(): the coordinator's GPU ring (hidden states)
    ready_event: str  # hex IPC handle: recorded after the hidden states are written
    sync: str = "host"  # how each side orders after the other's GPU work: see cuda_ipc.SYNC_MODES
    # the device link's offer (expertmesh/transport/link.py): {"area": cuda_ipc.share() of the
    # request area, "rows": its rows R, "top_k": K}; None: no link on this stream
    link: dict | None = None


@dataclass(frozen=True)
class Hello:
    transport: str  # "tcp" | "shm" | "cuda_ipc"
    segment: str  # "" for tcp
    size: int  # bytes of the segment
    ring_offset: int
    ring_bytes: int
    token: str  # hex; also written in the segment's header: opening it proves a shared /dev/shm
    cuda: CudaHello | None = None
    # the host link's offer (shm only; cpu_expert_server/hostlink.py): {"offset": where the
    # request area starts in the segment (link_layout.host_areas: the answer area follows),
    # "rows": R, "hidden": H, "top_k": K, "dtype": the areas' payload dtype}; None: no offer
    host_link: dict | None = None
    # a relayed link's offer (tcp only; relay.py): {"rows": R, "hidden": H, "top_k": K,
    # "dtype": the areas' payload dtype, "layers": MoE layers a step carries, "timeout_ms": the
    # server relay's wait limit, "token": 32 hex digits for its connection}; None: no offer
    relay: dict | None = None

    def encode(self) -> bytes:
        d = asdict(self)
        for name in ("host_link", "relay"):
            if d[name] is None:
                del d[name]  # NOTE: a server that predates the field reads the rest
        return MAGIC + json.dumps(d).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Hello:
        d = _load(raw)
        try:
            cuda = d.pop("cuda", None)
            hello = cls(**d, cuda=CudaHello(**cuda) if cuda is not None else None)
        except TypeError as e:
            raise HandshakeError(f"malformed fast-path handshake: {e}") from None
        if hello.transport == "tcp":
            _check_tcp(hello)
            return hello
        if not is_segment_name(hello.segment):
            raise HandshakeError(f"fast-path handshake: {hello.segment!r} is not an expertmesh segment name")
        if not isinstance(hello.token, str) or len(hello.token) != 32:
            raise HandshakeError("fast-path handshake: the token must be 32 hex digits")
        if hello.transport not in TRANSPORTS[1:]:
            raise HandshakeError(f"unknown fast path {hello.transport!r}")
        for name in ("size", "ring_offset", "ring_bytes"):
            if not isinstance(getattr(hello, name), int) or getattr(hello, name) < 0:
                raise HandshakeError(f"fast-path handshake: {name} must be a non-negative integer")
        if hello.ring_offset + hello.ring_bytes > hello.size:
            raise HandshakeError("fast-path handshake: the ring does not fit in the segment")
        if hello.host_link is not None:
            _check_host_link(hello)
        if hello.relay is not None:
            raise HandshakeError("fast-path handshake: a relay comes with tcp only")
        if (hello.transport == "cuda_ipc") != (hello.cuda is not None):
            raise HandshakeError("fast-path handshake: CUDA fields must come with cuda_ipc only")
        if hello.cuda is not None and hello.cuda.sync not in SYNC_MODES:
            raise HandshakeError(f"fast-path handshake: unknown CUDA sync {hello.cuda.sync!r}")
        if hello.cuda is not None and hello.cuda.link is not None:
            _check_link(hello.cuda.link)
        return hello


@dataclass(frozen=True)
class Ack:
    transport: str  # what the server serves this stream with: may be slower than asked
    reason: str = ""  # why it is slower, if it is
    # out_ring (cuda_ipc.share()) and done_event (hex); with a device link offered, link_area
    # (cuda_ipc.share() of the answer area) when accepted, or link_reason (why not)
    cuda: dict = field(default_factory=dict)
    # tcp: {"port": the data listener's port, "tls": bool, "buffer": the largest frame body it takes}
    tcp: dict = field(default_factory=dict)
    # with a host link offered: {"accepted": True}, or {"reason": why not}
    host_link: dict = field(default_factory=dict)
    # with a relay offered (tcp): {"accepted": True}, or {"reason": why not}
    relay: dict = field(default_factory=dict)

    def encode(self) -> bytes:
        d = asdict(self)
        for name in ("host_link", "relay"):
            if not d[name]:
                del d[name]  # NOTE: a coordinator that predates the field reads the rest
        return MAGIC + json.dumps(d).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Ack:
        try:
            ack = cls(**_load(raw))
        except TypeError as e:
            raise HandshakeError(f"malformed fast-path answer: {e}") from None
        if ack.transport not in TRANSPORTS:
            raise HandshakeError(f"unknown transport {ack.transport!r} in the fast-path answer")
        if not isinstance(ack.host_link, dict):
            raise HandshakeError(f"fast-path answer: host_link must be an object, got {ack.host_link!r}")
        if not isinstance(ack.relay, dict) or (ack.relay and ack.transport != "tcp"):
            raise HandshakeError(f"fast-path answer: relay must be an object, on tcp only, got {ack.relay!r}")
        if ack.transport == "tcp":
            tcp = ack.tcp if isinstance(ack.tcp, dict) else {}
            port, tls = tcp.get("port"), tcp.get("tls")
            if not (isinstance(port, int) and 0 < port < 65536 and isinstance(tls, bool)):
                raise HandshakeError(f"fast-path answer: tcp needs a port and a tls flag, got {ack.tcp!r}")
        return ack


def _check_tcp(hello: Hello) -> None:
    if (
        hello.segment
        or hello.size
        or hello.ring_offset
        or hello.cuda is not None
        or hello.host_link is not None
    ):
        raise HandshakeError(
            "fast-path handshake: a tcp hello names no segment, no CUDA fields and no host link"
        )
    if not _is_token(hello.token):
        raise HandshakeError("fast-path handshake: the token must be 32 hex digits")
    if hello.relay is not None:
        _check_relay(hello.relay, hello.token)
    b = hello.ring_bytes
    if not isinstance(b, int) or isinstance(b, bool) or not 4096 <= b <= MAX_TCP_BUFFER:
        raise HandshakeError(
            f"fast-path handshake: tcp buffer of {b!r} bytes outside [4096, {MAX_TCP_BUFFER}]"
        )


def _is_token(t: object) -> bool:
    if not isinstance(t, str) or len(t) != 32:
        return False
    try:
        bytes.fromhex(t)
    except ValueError:
        return False
    return True


RELAY_MAX_LAYERS = 1023  # < link_layout.STEP_SPAN: a step's flag values stay apart
RELAY_MAX_TIMEOUT_MS = 600_000


def _check_relay(offer: object, stream_token: str) -> None:
    ints = {"rows": 1 << 16, "hidden": 1 << 20, "top_k": 1 << 16, "layers": RELAY_MAX_LAYERS,
            "timeout_ms": RELAY_MAX_TIMEOUT_MS}  # fmt: skip
    ok = isinstance(offer, dict) and set(offer) == {*ints, "dtype", "token"}
    if ok:
        assert isinstance(offer, dict)
        ok = offer["dtype"] in LINK_DTYPES and _is_token(offer["token"]) and offer["token"] != stream_token
        for name, top in ints.items():
            v = offer[name]
            ok = ok and isinstance(v, int) and not isinstance(v, bool) and 0 < v <= top
    if not ok:
        raise HandshakeError(
            "fast-path handshake: the relay offer needs positive rows, hidden, top_k, layers "
            f"(< {RELAY_MAX_LAYERS + 1}), timeout_ms (<= {RELAY_MAX_TIMEOUT_MS}), a dtype name and "
            "a token of 32 hex digits other than the stream's"
        )


def _check_link(link: object) -> None:
    ok = isinstance(link, dict) and isinstance(link.get("area"), dict)
    for name in ("rows", "top_k"):
        v = link.get(name) if isinstance(link, dict) else None
        ok = ok and isinstance(v, int) and not isinstance(v, bool) and 0 < v <= 1 << 16
    if not ok:
        raise HandshakeError("fast-path handshake: the link offer needs an area and positive rows, top_k")


def _check_host_link(hello: Hello) -> None:
    offer = hello.host_link
    ints = ("offset", "rows", "hidden", "top_k")
    ok = isinstance(offer, dict) and set(offer) == {*ints, "dtype"} and offer["dtype"] in LINK_DTYPES
    if ok:
        assert isinstance(offer, dict)
        for name in ints:
            v = offer[name]
            ok = ok and isinstance(v, int) and not isinstance(v, bool) and (0 if name == "offset" else 1) <= v
        ok = ok and offer["rows"] <= 1 << 16 and offer["top_k"] <= 1 << 16 and offer["hidden"] <= 1 << 20
    if not ok:
        raise HandshakeError(
            "fast-path handshake: the host link offer needs offset, positive rows, hidden, top_k and a dtype name"
        )
    assert isinstance(offer, dict)
    if hello.transport != "shm":
        raise HandshakeError("fast-path handshake: a host link comes with shm only")
    req, _, end = host_areas(
        offer["offset"], offer["rows"], offer["hidden"], offer["top_k"], wire.DTYPES[offer["dtype"]]
    )
    if req < hello.ring_offset + hello.ring_bytes or end > hello.size:
        raise HandshakeError(
            f"fast-path handshake: the host link's areas [{req}, {end}) are not after the ring "
            f"[{hello.ring_offset}, {hello.ring_offset + hello.ring_bytes}) inside the {hello.size}-byte segment"
        )


def _load(raw: bytes) -> dict:
    if not raw.startswith(MAGIC):
        raise HandshakeError(f"fast-path handshake does not start with {MAGIC!r} ({len(raw)} bytes)")
    try:
        d = json.loads(raw[len(MAGIC) :])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HandshakeError(f"fast-path handshake is not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise HandshakeError("fast-path handshake must be a JSON object")
    return d
