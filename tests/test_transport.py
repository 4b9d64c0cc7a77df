"""Fast-path building blocks in one process: ring allocator, descriptors (and their rejection
when truncated, corrupted or out of bounds), handshake messages, the negotiation table,
segment names and the janitor."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from expertmesh.transport import cuda_ipc, negotiate, segment
from expertmesh.transport import descriptor as dsc
from expertmesh.transport.handshake import Ack, HandshakeError, Hello
from expertmesh.transport.negotiate import Side
from expertmesh.transport.ring import Ring

# ---------------------------------------------------------------------- ring


def test_ring_fifo_reuse_wrap_and_no_room():
    r = Ring(4096, align=256)
    a, b = r.alloc(1000), r.alloc(1000)  # 1024 + 1024
    assert (a.offset, b.offset) == (0, 1024)
    assert r.alloc(5000) is None  # larger than the ring: the caller uses gRPC
    c = r.alloc(2048)
    assert c is not None and c.offset == 2048
    assert r.alloc(1) is None  # full
    r.free(b)  # out of order: the space comes back only when `a` does
    assert r.alloc(1) is None
    r.free(a)
    d = r.alloc(1500)  # 1536 at 0 (the end is taken by c)
    assert d is not None and d.offset == 0
    r.free(c)
    e = r.alloc(2048)  # right after d: [1536, 3584) does not straddle the end
    assert e is not None and e.offset == 1536
    r.free(d)
    r.free(e)
    assert r.used == 0 and r.head == 0


def test_ring_never_straddles_the_end():
    r = Ring(4096, align=256)
    a = r.alloc(3072)
    r.alloc(512)
    r.free(a)
    w = r.alloc(1024)  # 512 left at the end: skipped, placed at 0
    assert w is not None and w.offset == 0


# ---------------------------------------------------------------------- descriptors


def _request(**kw) -> dsc.Request:
    args = dict(
        seq=7,
        generation=3,
        layer=1,
        tokens=4,
        hidden=64,
        top_k=2,
        hidden_dtype=torch.float32,
        out_dtype=torch.float32,
        hidden_off=0,
        route_off=1024,
        out_off=1280,
    )
    return dsc.Request(**{**args, **kw})


def test_request_round_trip():
    req = _request(hidden_dtype=torch.bfloat16, out_dtype=torch.bfloat16, flags=dsc.FLAG_GPU)
    raw = req.pack()
    assert len(raw) == dsc.SIZE
    assert dsc.Request.parse(raw, host_bytes=4096, gpu_bytes=4096) == req


@pytest.mark.parametrize(
    "mangle, words",
    [
        (lambda raw: raw[:17], "truncated descriptor: 17 bytes"),
        (lambda raw: raw + b"x", "truncated descriptor"),
        (lambda raw: b"XXXX" + raw[4:], "bad descriptor magic"),
        (lambda raw: raw[:30] + bytes([raw[30] ^ 0x10]) + raw[31:], "checksum mismatch"),
        (lambda raw: raw[:-1] + bytes([raw[-1] ^ 1]), "checksum mismatch"),
        (lambda raw: bytes(dsc.SIZE), "bad descriptor magic"),
    ],
)
def test_corrupted_request_is_rejected(mangle, words):
    with pytest.raises(dsc.DescriptorError, match=words):
        dsc.Request.parse(mangle(_request().pack()), host_bytes=4096, gpu_bytes=0)


@pytest.mark.parametrize(
    "fields, words",
    [
        (dict(out_off=4000), "output .* outside the 4096-byte ring"),
        (dict(hidden_off=8), "not 64-byte aligned"),
        (dict(route_off=1 << 40), "routing block .* outside"),
        (dict(tokens=1 << 30), "hidden .* outside"),
        (dict(flags=dsc.FLAG_GPU), "has none"),
        (dict(flags=8), "unknown descriptor flags"),
        (dict(top_k=0), "top-k 0"),
    ],
)
def test_out_of_bounds_request_is_rejected(fields, words):
    raw = _request(**fields).pack()  # well-formed, with a valid checksum
    with pytest.raises(dsc.DescriptorError, match=words):
        dsc.Request.parse(raw, host_bytes=4096, gpu_bytes=0)


def test_unknown_dtype_code_is_rejected():
    raw = bytearray(_request().pack()[: dsc.SIZE - 4])
    raw[40] = 9  # hidden dtype code
    with pytest.raises(dsc.DescriptorError, match="unknown dtype code 9"):
        dsc.Request.parse(dsc._seal(bytes(raw)), host_bytes=4096, gpu_bytes=0)


def test_response_round_trip_and_long_message():
    r = dsc.Response(9, 3, 1.5, "x" * 1000)
    back = dsc.Response.parse(r.pack())
    assert (back.seq, back.code, back.compute_ms) == (9, 3, 1.5)
    assert back.message == "x" * dsc.MAX_MESSAGE
    assert dsc.is_kick(dsc.KICK) and not dsc.is_kick(r.pack())


# ---------------------------------------------------------------------- handshake


def _hello(**kw) -> Hello:
    args = dict(
        transport="shm",
        segment=f"expertmesh-1-2-{'ab' * 8}",
        size=4096 + 8192,
        ring_offset=4096,
        ring_bytes=8192,
        token="0" * 32,
    )
    return Hello(**{**args, **kw})


def test_hello_and_ack_round_trip():
    h = _hello()
    assert Hello.decode(h.encode()) == h
    a = Ack("shm", "no GPU")
    assert Ack.decode(a.encode()) == a


@pytest.mark.parametrize(
    "raw, words",
    [
        (b"garbage", "does not start with"),
        (b"EMHS1{not json", "not valid JSON"),
        (b"EMHS1[1, 2]", "JSON object"),
        (b'EMHS1{"transport": "shm"}', "malformed"),
        (_hello(segment="../../etc/passwd").encode(), "not an expertmesh segment name"),
        (_hello(transport="rdma").encode(), "unknown fast path"),
        (_hello(ring_bytes=1 << 40).encode(), "does not fit"),
        (_hello(transport="cuda_ipc").encode(), "CUDA fields"),
        (_hello().encode()[:-3], "not valid JSON"),
    ],
)
def test_bad_hello_is_rejected(raw, words):
    with pytest.raises(HandshakeError, match=words):
        Hello.decode(raw)


def _tcp_hello(**kw) -> Hello:
    return Hello(
        **{
            **dict(transport="tcp", segment="", size=0, ring_offset=0, ring_bytes=1 << 20, token="ab" * 16),
            **kw,
        }
    )


def test_tcp_hello_and_ack_round_trip():
    h = _tcp_hello()
    assert Hello.decode(h.encode()) == h
    a = Ack("tcp", tcp={"port": 5000, "tls": False})
    assert Ack.decode(a.encode()) == a


@pytest.mark.parametrize(
    "raw, words",
    [
        (_tcp_hello(segment=f"expertmesh-1-2-{'ab' * 8}").encode(), "names no segment"),
        (_tcp_hello(token="zz" * 16).encode(), "32 hex digits"),
        (_tcp_hello(ring_bytes=1 << 40).encode(), "tcp buffer"),
        (_tcp_hello(ring_bytes=True).encode(), "tcp buffer"),
        (Ack("tcp", tcp={"port": 0, "tls": False}).encode(), "needs a port"),
        (Ack("tcp", tcp={"port": 5000}).encode(), "needs a port"),
    ],
)
def test_bad_tcp_handshake_is_rejected(raw, words):
    decode = Ack.decode if b'"reason"' in raw else Hello.decode
    with pytest.raises(HandshakeError, match=words):
        decode(raw)


# ---------------------------------------------------------------------- negotiation

HOST, GPU = "boot-a", "GPU-1"
CPU_SRV = Side(HOST, "", ("shm",))
GPU_SRV = Side(HOST, GPU, ("shm", "cuda_ipc"))
COORD_CPU = Side(HOST)
COORD_GPU = Side(HOST, GPU)


@pytest.mark.parametrize(
    "requested, coord, server, want",
    [
        ("auto", COORD_CPU, CPU_SRV, "shm"),
        ("auto", COORD_GPU, GPU_SRV, "cuda_ipc"),
        ("auto", COORD_CPU, GPU_SRV, "shm"),
        ("auto", COORD_GPU, Side(HOST, "GPU-2", ("shm", "cuda_ipc")), "shm"),
        ("auto", COORD_GPU, Side("boot-b", GPU, ("shm", "cuda_ipc")), "grpc"),
        ("auto", COORD_CPU, Side(HOST, "", ()), "grpc"),
        ("auto", Side(""), Side(""), "grpc"),
        ("shm", COORD_GPU, GPU_SRV, "shm"),
        ("grpc", COORD_GPU, GPU_SRV, "grpc"),
        ("cuda_ipc", COORD_GPU, GPU_SRV, "cuda_ipc"),
        # a server on another GPU of the host: CUDA IPC only where ours reaches it by peer access
        ("auto", Side(HOST, GPU, peers=("GPU-2",)), Side(HOST, "GPU-2", ("shm", "cuda_ipc")), "cuda_ipc"),
        ("cuda_ipc", Side(HOST, GPU, peers=("GPU-2",)), Side(HOST, "GPU-2", ("shm", "cuda_ipc")), "cuda_ipc"),
        ("auto", Side(HOST, GPU, peers=("GPU-3",)), Side(HOST, "GPU-2", ("shm", "cuda_ipc")), "shm"),
        ("auto", Side("boot-b", GPU, peers=("GPU-2",)), Side(HOST, "GPU-2", ("shm", "cuda_ipc")), "grpc"),
        # the TCP data path: another host, or a server without shared memory; required: any host
        ("auto", COORD_GPU, Side("boot-b", GPU, ("tcp", "shm", "cuda_ipc")), "tcp"),
        ("auto", COORD_CPU, Side(HOST, "", ("tcp",)), "tcp"),
        ("auto", COORD_CPU, Side(HOST, "", ("tcp", "shm")), "shm"),
        ("tcp", COORD_GPU, Side(HOST, GPU, ("tcp", "shm", "cuda_ipc")), "tcp"),
    ],
)
def test_negotiation_picks_the_fastest_common_path(requested, coord, server, want):
    assert negotiate.choose(requested, coord, server).transport == want


@pytest.mark.parametrize(
    "requested, coord, server, words",
    [
        ("shm", COORD_CPU, Side("boot-b", "", ("shm",)), "another host"),
        ("shm", COORD_CPU, Side(HOST, "", ()), "--no-shm"),
        ("cuda_ipc", COORD_CPU, GPU_SRV, "does not run on CUDA"),
        ("cuda_ipc", COORD_GPU, Side(HOST, "GPU-2", ("shm", "cuda_ipc")), "another GPU"),
        (
            "cuda_ipc",
            Side(HOST, GPU, peers=("GPU-3",)),
            Side(HOST, "GPU-2", ("shm", "cuda_ipc")),
            "peer access",
        ),
        ("cuda_ipc", COORD_GPU, CPU_SRV, "offers no CUDA IPC"),
        ("tcp", COORD_CPU, CPU_SRV, "--no-tcp"),
    ],
)
def test_required_path_that_is_impossible_says_why(requested, coord, server, words):
    with pytest.raises(negotiate.NegotiationError, match=words):
        negotiate.choose(requested, coord, server, "cpu0")


def test_auto_accepts_a_slower_answer_required_does_not():
    assert negotiate.acceptable("auto", "cuda_ipc", "grpc")
    assert negotiate.acceptable("shm", "shm", "shm")
    assert not negotiate.acceptable("shm", "shm", "grpc")
    assert not negotiate.acceptable("cuda_ipc", "cuda_ipc", "shm")
    assert negotiate.acceptable("tcp", "tcp", "tcp") and not negotiate.acceptable("tcp", "tcp", "grpc")


def test_wrapped_memory_is_an_alias_not_a_copy():
    """cuda_ipc.wrap (how a peer GPU's memory becomes a tensor of ours) on host memory: the
    tensor reads and writes the same bytes, and outlives the wrapper call."""
    buf = np.zeros(4096, dtype=np.uint8)
    t = cuda_ipc.wrap(buf.ctypes.data, buf.nbytes, torch.device("cpu"))
    assert t.shape == (4096,) and t.dtype == torch.uint8 and t.data_ptr() == buf.ctypes.data
    buf[7] = 42
    assert int(t[7]) == 42
    view = t[64:128].view(torch.int32)
    del t
    view.fill_(-1)
    assert (buf[64:128] == 255).all() and buf[63] == 0 and buf[128] == 0


# ---------------------------------------------------------------------- segments


def test_segment_create_attach_unlink(tmp_path):
    name = segment.new_name()
    mm = segment.create(name, 8192, tmp_path)
    assert sorted(os.listdir(tmp_path)) == [name, name + ".req", name + ".resp"]
    mm[100:104] = b"ping"
    other = segment.attach(name, 8192, tmp_path)
    fds = segment.open_fifos(name, tmp_path)
    segment.unlink(name, tmp_path)
    assert os.listdir(tmp_path) == []  # the mappings and pipes outlive the names
    assert other[100:104] == b"ping"
    os.write(fds[0], b"x")
    assert os.read(fds[0], 1) == b"x"
    for fd in fds:
        os.close(fd)
    with pytest.raises(segment.SegmentError, match="announced"):
        segment.create(name, 4096, tmp_path)
        segment.attach(name, 8192, tmp_path)
    segment.unlink(name, tmp_path)
    with pytest.raises(ValueError, match="not an expertmesh segment"):
        segment.attach("../x", 10, tmp_path)
    mm.close()
    other.close()


def test_sweep_removes_only_what_a_dead_process_left(tmp_path):
    p = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead = int(p.stdout)
    assert segment.process_start(dead) is None
    me, start = os.getpid(), segment.process_start(os.getpid())
    leaked = [f"expertmesh-{dead}-123-{'a' * 16}{s}" for s in ("", ".req", ".resp")]
    reused = f"expertmesh-{me}-{(start or 0) + 1}-{'b' * 16}"  # our pid, another start time
    live = f"expertmesh-{me}-{start}-{'c' * 16}"
    young = f"expertmesh-{dead}-123-{'d' * 16}"
    foreign = "other-program-segment"
    for n in [*leaked, reused, live, young, foreign]:
        (tmp_path / n).write_bytes(b"")
    old = time.time() - 60
    for n in [*leaked, reused, live]:
        os.utime(tmp_path / n, (old, old))
    removed = segment.sweep(tmp_path, min_age_s=5.0)
    assert sorted(removed) == sorted([*leaked, reused])
    assert sorted(os.listdir(tmp_path)) == sorted([live, young, foreign])
