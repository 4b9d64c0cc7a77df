"""The C quantiser (kernels/quantise.c) against its reference, the torch path
(packing.quantize_rows_torch): the same bytes for int8 and int4, tiled and row formats, from
bf16, float16 and float32, with the awkward values (zero groups, scales clamped to 1e-12,
the largest floats, exact and near .5 ties, negative zero, subnormals); inf and NaN go to torch.
Then a CPU backend's int4 load gives the same slot bytes either way, and Python runs on
beside a call (it holds no GIL)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from benchmarks.bench_memory import write_checkpoint
from cpu_expert_server import packing
from cpu_expert_server.backend import CpuExpertBackend
from cpu_expert_server.kernels import quantise as qc
from expertmesh.checkpoint import CheckpointReader
from expertmesh.worker.server import slot_views
from expertmesh.worker.slots import SlotTable


@pytest.fixture(autouse=True)
def built() -> None:
    """These tests run the C quantiser: where it does not build, that is the failure (the
    fallback to torch has tests of its own below)."""
    if qc.load() is None:
        pytest.fail(f"the C quantiser did not build on a machine with a C compiler: {qc.unavailable()}")


DTYPES = [torch.bfloat16, torch.float32, torch.float16]


def c_path(w: torch.Tensor, wdtype: str, g: int, isa: int | None = None) -> torch.Tensor:
    """The C quantiser's bytes (in the loops of ``isa``), failing, not falling back, where it
    refuses the input."""
    *lead, c = w.shape
    out = torch.full((*lead, packing.row_bytes(wdtype, c, g)), 0xA5, dtype=torch.uint8)  # stale bytes
    assert qc.quantise(w, wdtype, g, packing.tiled(wdtype, lead[-1], g), out, isa)
    return out


def assert_same(w: torch.Tensor, wdtype: str, g: int) -> None:
    """The torch path's bytes from every ISA's loops this CPU runs."""
    want = packing.quantize_rows_torch(w, wdtype, g)
    for isa in range(qc.isa() + 1):
        got = c_path(w, wdtype, g, isa)
        assert got.shape == want.shape
        diff = (got != want).nonzero()
        assert diff.numel() == 0, f"{qc.ISAS[isa]}: {len(diff)} bytes differ, first at {diff[:4].tolist()}"


def awkward(r: int, c: int, dtype: torch.dtype, g: int, seed: int = 0) -> torch.Tensor:
    """[R, C] random rows of very different scales whose first groups of ``g`` (as many as
    there are) are: zeros, negative zeros, tiny values (scale clamped to 1e-12), the dtype's
    largest values, subnormals, small values, and negative zeros among values."""
    torch.manual_seed(seed)
    info = torch.finfo(dtype)
    span = 8 if dtype == torch.float16 else 20  # row scales 2^-span .. 2^span, all finite
    w = torch.randn(r, c) * torch.rand(r, 1) * 4
    w = w * torch.exp2(torch.randint(-span, span, (r, 1)).float())
    small = 1e-7 if dtype == torch.float16 else 1e-14
    largest = torch.randn(g).sign() * info.max * torch.rand(g)
    largest[0] = info.max
    mixed = torch.randn(g)
    mixed[: g // 2] = -0.0
    special = [
        torch.zeros(g),
        torch.full((g,), -0.0),
        torch.randn(g) * small,
        largest,
        torch.randn(g) * info.tiny,  # mostly subnormal
        torch.randn(g) * small * 1e4,
        mixed,
    ]
    groups = w.view(-1, g)  # [R * C/G, G]
    for k, values in enumerate(special[: len(groups)]):
        groups[k] = values
    return w.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("r", "c", "g"), [(32, 128, 64), (48, 256, 64), (48, 256, 128), (32, 256, 256)])
@pytest.mark.parametrize("wdtype", ["int8", "int4"])
def test_tiled_bytes_equal_torch(wdtype, r, c, g, dtype):
    w = awkward(r, c, dtype, g)
    assert packing.tiled(wdtype, r, g)
    assert_same(w, wdtype, g)
    assert_same(torch.stack([w, -w, w / 3]), wdtype, g)  # [S, R, C]: several matrices' blocks


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("r", "c", "g"), [(5, 128, 64), (16, 96, 32), (7, 100, 10), (9, 256, 256), (1, 8, 8)]
)
@pytest.mark.parametrize("wdtype", ["int8", "int4"])
def test_row_format_bytes_equal_torch(wdtype, r, c, g, dtype):
    if wdtype == "int4" and g % 2:
        g = 2 * g
    w = awkward(r, c, dtype, g, seed=1)
    assert not packing.tiled(wdtype, r, g)
    assert_same(w, wdtype, g)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("wdtype", ["int8", "int4"])
def test_exact_ties_round_to_even(wdtype, dtype):
    """Groups whose scale is a power of two (absmax = QMAX * 2^k), so ``w / scale`` lands
    exactly on k + 0.5: half to even, as torch.round."""
    qmax = packing.QMAX[wdtype]
    halves = torch.arange(-qmax, qmax) + 0.5  # -126.5 .. 126.5 (int8), -6.5 .. 6.5 (int4)
    rows = []
    for k in (-3, 0, 2):
        row = torch.cat([halves, torch.tensor([qmax] * (128 - len(halves) % 128))])[:128]
        row[-1] = qmax  # the group's absmax: scale = 2^k exactly
        rows.append(row * 2.0**k)
    w = torch.stack(rows * 16)[:32]  # [32, 128]: tiled with g=64 and g=128
    w = w.to(dtype)
    assert torch.equal(w.float(), torch.stack(rows * 16)[:32])  # every value exact in dtype
    for g in (64, 128):
        assert_same(w, wdtype, g)
        assert_same(w[:5], wdtype, g)
    # the ties themselves: round half to even, int4 offset by 8
    q = packing.dequantize_rows(c_path(w[:16], wdtype, 128), wdtype, 128, 128)
    assert torch.equal(q[1], torch.round(w[1].float() / 1.0) * 1.0)


def test_near_ties_need_a_true_division():
    """float32 values a few ulps either side of (k + 0.5) * scale for a scale whose reciprocal
    is inexact: a reciprocal multiply rounds some of them the other way (checked here, so the
    test can tell), the C quantiser as torch's division does."""
    torch.manual_seed(3)
    scale = torch.tensor(3.0 / 127)  # absmax 3.0
    k = torch.randint(-126, 126, (32 * 256,)).float()
    mid = (k + 0.5) * scale
    ulps = torch.randint(-3, 4, mid.shape, dtype=torch.int32)
    w = mid.view(torch.int32).add(ulps).view(torch.float32)  # [32 * 256]
    w = w.view(32, 4, 64)
    w[:, :, 0] = 3.0  # every group's absmax
    w = w.reshape(32, 256)
    s = torch.tensor(3.0) / 127
    assert not torch.equal(torch.round(w / s), torch.round(w * (1 / s)))
    assert_same(w, "int8", 64)
    assert_same(w[:7], "int8", 64)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("wdtype", ["int8", "int4"])
def test_inf_and_nan_are_left_to_torch(wdtype, dtype, bad):
    """A non-finite value makes torch convert NaN codes to integers (bytes C leaves undefined):
    the C quantiser refuses the matrix and quantize_rows gives torch's bytes."""
    w = awkward(32, 128, dtype, 64)
    w[20, 70] = bad
    out = torch.empty(32, packing.row_bytes(wdtype, 128, 64), dtype=torch.uint8)
    assert not qc.quantise(w, wdtype, 64, True, out)
    assert torch.equal(packing.quantize_rows(w, wdtype, 64), packing.quantize_rows_torch(w, wdtype, 64))


def test_quantize_rows_takes_the_c_path_and_falls_back(monkeypatch):
    """quantize_rows writes into ``out`` through C where it can; float64 (a dtype C does not
    read), a non-contiguous ``out`` and no library go to torch, with the same bytes."""
    calls: list[bool] = []
    real = qc.quantise

    def quantise(*a):
        calls.append(real(*a))
        return calls[-1]

    monkeypatch.setattr(qc, "quantise", quantise)
    w = awkward(48, 256, torch.bfloat16, 64)
    want = packing.quantize_rows_torch(w, "int4", 64)
    slot = torch.zeros(2, 48, want.shape[-1], dtype=torch.uint8)
    assert packing.quantize_rows(w, "int4", 64, slot[1]).data_ptr() == slot[1].data_ptr()
    assert torch.equal(slot[1], want) and calls == [True]
    assert torch.equal(packing.quantize_rows(w.double(), "int4", 64), want) and calls[-1] is False
    # the row format (5 rows) copies into any ``out``, here rows apart
    wide = torch.zeros(5, 2 * want.shape[-1], dtype=torch.uint8)[:, : want.shape[-1]]
    packing.quantize_rows(w[:5], "int4", 64, wide)
    assert torch.equal(wide, packing.quantize_rows_torch(w[:5], "int4", 64)) and calls[-1] is False
    monkeypatch.setattr(qc, "load", lambda: None)
    assert torch.equal(packing.quantize_rows(w, "int4", 64), want) and calls[-1] is False


def test_backend_int4_load_gives_the_torch_paths_slot_bytes(tmp_path, monkeypatch):
    """A CPU backend's int4 load (reader threads' read_packed, and pack_weights for staged
    experts) fills the slots with the same bytes through C as through torch."""
    h, inter, e, layers = 128, 64, 6, 2
    path = write_checkpoint(tmp_path, h, inter, e, layers, torch.bfloat16)
    used: list[bool] = []
    real = qc.quantise

    def load(c_enabled: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
        def quantise(*a):
            used.append(c_enabled and real(*a))
            return used[-1]

        monkeypatch.setattr(qc, "quantise", quantise)
        b = CpuExpertBackend(threads=1, weight_dtype="int4")
        t = SlotTable(
            CheckpointReader(path), torch.bfloat16, torch.device("cpu"), e, b.pack_weights,
            views=slot_views(b), read_packed=b.read_packed,
        )  # fmt: skip
        t.preload([5, 0, 3])
        t.prepare(1, {0: [4, 5, 1], 1: [2, 0, 3, 1]})
        t.commit(1)
        live = [t.live.layers[i] for i in range(layers)]
        return [(a.w13[: len(a.experts)].clone(), a.w2[: len(a.experts)].clone()) for a in live]

    with_c = load(True)
    assert used and all(used)
    used.clear()
    with_torch = load(False)
    assert used and not any(used)
    for (a13, a2), (b13, b2) in zip(with_c, with_torch, strict=True):
        assert torch.equal(a13, b13) and torch.equal(a2, b2)


def test_a_call_holds_no_gil():
    """While one thread quantises a large matrix, another keeps running Python: the longest
    gap between its loop's turns inside the call is a small part of the call (with the GIL
    held, as through ctypes.PyDLL, it spans nearly the whole call)."""
    w = torch.randn(8192, 2048).bfloat16()
    out = torch.empty(8192, packing.row_bytes("int4", 2048, 64), dtype=torch.uint8)
    done = threading.Event()
    span: list[float] = []

    def work() -> None:
        t0 = time.perf_counter()
        assert qc.quantise(w, "int4", 64, True, out, isa=0)  # the slowest loops: ~25 ms here
        span.extend((t0, time.perf_counter()))
        done.set()

    beats = []
    t = threading.Thread(target=work)
    t.start()
    while not done.is_set():
        beats.append(time.perf_counter())
    t.join()
    a, b = span
    inside = [a, *(x for x in beats if a < x < b), b]
    gap = max(y - x for x, y in zip(inside, inside[1:]))
    assert gap < 0.5 * (b - a), f"{gap=} call={b - a}"
