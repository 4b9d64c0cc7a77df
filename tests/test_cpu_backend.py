"""The CPU expert backend against the plain torch reference (expertmesh.experts.torch_moe).

Bounds: float32 weights match to float32 rounding (rel 1e-5); bf16 within bf16 rounding of the
reference (rel 1e-2, the reference itself rounds at every step); int8/int4 match the reference
run on the *dequantised* weights to float32 rounding, and each dequantised weight is within half
a quantisation step (group amax / qmax / 2) of the original. Both the C kernel and the torch
fallback, both the decode (GEMV) and the prefill (GEMM) path.

Integer dot products (int8/int4 with groups a multiple of 64, activations quantised to int8 per
token and group): within 1e-3 of a float64 reference that quantises the activations the same way
(the residue is fp32 summation order flipping a rounding), and within 3e-2 of the reference on
the dequantised weights with unquantised activations (the activations' own rounding; measured
~0.8e-2 here at these widths). Each ISA variant this CPU has is checked (AVX2, AVX512-VNNI,
AVX512_BF16, AMX; the ones it lacks are skipped by name).
"""

from __future__ import annotations

import logging
import os
import threading

import pytest
import torch

from cpu_expert_server import kernels
from cpu_expert_server.backend import (
    _QARGS,
    GEMV_INT_MAX_TOKENS,
    GEMV_MAX_TOKENS,
    CpuExpertBackend,
    make_backend,
)
from cpu_expert_server.packing import (
    PER_ROW,
    QMAX,
    PackedFormat,
    dequantize_rows,
    interleave,
    quantize_rows,
    split_gate_up,
    unpack,
)
from expertmesh.experts import torch_moe
from expertmesh.lora.moe import LoRABatch, MoELoRAWeights, moe_lora_reference

S, H, I, K = 6, 96, 64, 3  # noqa: E741 (the shape legend of expertmesh.experts)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def inputs(t: int, dtype: torch.dtype, seed: int, h: int = H, i: int = I):  # noqa: E741
    """Fresh random problem; widths divisible by 32 take the kernel's vector path, others not."""
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(S, 2 * i, h, generator=g) / h**0.5).to(dtype)  # [S, 2I, H]
    w2 = (torch.randn(S, h, i, generator=g) / i**0.5).to(dtype)  # [S, H, I]
    x = torch.randn(t, h, generator=g).to(dtype)  # [T, H]
    slot_ids = torch.randint(-1, S, (t, K), generator=g)  # [T, K], -1 = expert elsewhere
    weights = torch.rand(t, K, generator=g)  # [T, K]
    return x, w13, w2, slot_ids, weights


def unpack_reference(
    fmt: PackedFormat, p13: torch.Tensor, p2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed quantised weights -> plain [S, 2I, H], [S, H, I] float32 in the reference's order."""
    w13 = dequantize_rows(p13, fmt.wdtype, fmt.hidden, fmt.g13)  # [S, 2I, H] interleaved
    s = w13.shape[0]
    w13 = w13.view(s, fmt.inter // fmt.rb, 2, fmt.rb, fmt.hidden).transpose(1, 2).reshape(s, -1, fmt.hidden)
    return w13, dequantize_rows(p2, fmt.wdtype, fmt.inter, fmt.g2)


@pytest.fixture(scope="module", params=[True, False], ids=["kernel", "torch-fallback"])
def use_kernel(request) -> bool:
    if request.param and kernels.load() is None:
        pytest.fail("the C kernel did not build on a machine with a C compiler (see the log)")
    return request.param


@pytest.mark.parametrize("t", [1, 11, 120])  # 120 tokens over 6 slots: the GEMM path
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("h,i", [(H, I), (72, 40)])
def test_unquantised_matches_reference(use_kernel, t, dtype, tol, h, i):
    x, w13, w2, slot_ids, weights = inputs(t, dtype, seed=t, h=h, i=i)
    b = CpuExpertBackend(threads=2, use_kernel=use_kernel)
    out = b.forward(x, *b.pack_weights(w13, w2), slot_ids, weights)
    ref = torch_moe(x.double(), w13.double(), w2.double(), slot_ids, weights.double())
    assert out.dtype == x.dtype and out.shape == x.shape
    assert rel(out, ref) < tol, rel(out, ref)


@pytest.mark.parametrize("wdtype", ["int8", "int4"])
@pytest.mark.parametrize("t", [1, 11, 120])
@pytest.mark.parametrize("group", [16, 32])  # 16: the kernel's scalar path, 32: its vector path
def test_quantised_matches_dequantised_reference(use_kernel, wdtype, t, group):
    x, w13, w2, slot_ids, weights = inputs(t, torch.float32, seed=100 + t)
    b = CpuExpertBackend(threads=2, weight_dtype=wdtype, group=group, use_kernel=use_kernel)
    p13, p2 = b.pack_weights(w13, w2)
    assert b.fmt is not None and p13.dtype == torch.uint8
    out = b.forward(x, p13, p2, slot_ids, weights)
    ref = torch_moe(
        x.double(), *(w.double() for w in unpack_reference(b.fmt, p13, p2)), slot_ids, weights.double()
    )
    assert rel(out, ref) < 1e-5, rel(out, ref)
    # and the quantisation itself is no worse than a rounding step
    assert rel(out, torch_moe(x, w13, w2, slot_ids, weights)) < (0.02 if wdtype == "int8" else 0.2)


@pytest.mark.parametrize("wdtype,g", [("int8", 16), ("int4", 16), ("int4", 48)])
def test_quantisation_error_is_half_a_step(wdtype, g):
    w = torch.randn(5, 96) * torch.logspace(-3, 1, 96)  # mixed magnitudes across groups
    deq = dequantize_rows(quantize_rows(w, wdtype, g), wdtype, 96, g)
    step = w.view(5, -1, g).abs().amax(-1, keepdim=True) / QMAX[wdtype]  # [5, 96/G, 1]
    assert ((deq - w).view(5, -1, g).abs() <= step / 2 * (1 + 1e-5)).all()


def test_bytes_per_weight_shrink():
    w13, w2 = torch.randn(1, 2 * 768, 2048).bfloat16(), torch.randn(1, 2048, 768).bfloat16()
    size = {}
    for wd in ("bfloat16", "int8", "int4"):
        p13, p2 = CpuExpertBackend(weight_dtype=wd, use_kernel=False).pack_weights(w13, w2)
        size[wd] = p13.numel() * p13.element_size() + p2.numel() * p2.element_size()
    assert size["bfloat16"] / size["int8"] > 1.9 and size["bfloat16"] / size["int4"] > 3.5, size


def test_interleave_keeps_gate_and_up_pairs():
    w13 = torch.arange(2 * 2 * 32, dtype=torch.float32).view(2, 32, 2)  # [S=2, 2I=32, H=2]
    rb = PackedFormat.for_shape("bfloat16", 2, 16).rb
    out = interleave(w13, rb)
    assert torch.equal(out[:, :rb], w13[:, :rb]) and torch.equal(out[:, rb : 2 * rb], w13[:, 16 : 16 + rb])


def test_empty_and_bad_inputs(use_kernel):
    b = CpuExpertBackend(threads=2, weight_dtype="int8", use_kernel=use_kernel)
    x, w13, w2, slot_ids, weights = inputs(3, torch.float32, seed=7)
    p13, p2 = b.pack_weights(w13, w2)
    e13, e2 = b.pack_weights(w13[:0], w2[:0])  # a server holding no experts of a layer
    assert torch.equal(b.forward(x, e13, e2, slot_ids.clamp(max=-1), weights), torch.zeros_like(x))
    assert b.forward(x[:0], p13, p2, slot_ids[:0], weights[:0]).shape == (0, H)
    with pytest.raises(ValueError, match="slot ids"):
        b.forward(x, p13, p2, slot_ids.clamp(min=0) + S, weights)
    with pytest.raises(ValueError, match="weight_dtype"):
        make_backend(weight_dtype="int3")


def test_missing_compiler_falls_back_with_a_logged_reason(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("EXPERTMESH_CACHE", str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="expertmesh.cpu_kernels"):
        b = CpuExpertBackend(threads=1)
    assert b.lib is None and "torch fallback" in caplog.text and "no-such-cc" in caplog.text
    x, w13, w2, slot_ids, weights = inputs(2, torch.float32, seed=3)
    assert (
        rel(
            b.forward(x, *b.pack_weights(w13, w2), slot_ids, weights),
            torch_moe(x, w13, w2, slot_ids, weights),
        )
        < 1e-5
    )


@pytest.mark.parametrize("wdtype", ["bfloat16", "int8"])
def test_moe_lora_matches_reference_on_dequantised_weights(wdtype):
    x, w13, w2, slot_ids, weights = inputs(5, torch.float32, seed=11)
    g = torch.Generator().manual_seed(12)
    lora = MoELoRAWeights(
        torch.randn(2, S, 4, H, generator=g) / 8,  # a13 [L, S, R13, H]
        torch.randn(2, S, 2 * I, 4, generator=g) / 8,  # b13 [L, S, 2I, R13]
        torch.randn(2, S, 4, I, generator=g) / 8,  # a2 [L, S, R2, I]
        torch.randn(2, S, H, 4, generator=g) / 8,  # b2 [L, S, H, R2]
    )
    token_adapter = torch.tensor([0, -1, 1, 1, 0])  # [T]
    b = CpuExpertBackend(threads=2, weight_dtype=wdtype, group=32)
    p13, p2 = b.pack_weights(w13, w2)
    out = b.forward(x, p13, p2, slot_ids, weights, LoRABatch(lora, token_adapter))
    base13, base2 = unpack(p13, p2, b.fmt, torch.float32) if b.fmt is not None else (w13, w2)
    ref = moe_lora_reference(x, base13, base2, slot_ids, weights, lora, token_adapter)
    assert rel(out, ref) < 1e-5, rel(out, ref)
    assert rel(out, b.forward(x, p13, p2, slot_ids, weights)) > 1e-3  # the adapters did something


def qact_roundtrip(v: torch.Tensor, g: int) -> torch.Tensor:
    """[..., C] -> the kernel's activation quantisation undone: symmetric int8 per group of g,
    rounded half away from zero."""
    vg = v.float().reshape(*v.shape[:-1], -1, g)  # [..., C/G, G]
    amax = vg.abs().amax(-1, keepdim=True)
    # NOTE: 127 / amax as one fp32 division, as the kernel does (torch's scalar / tensor is
    # reciprocal-then-multiply, an ulp off at times, which flips ties: bf16-valued x hit them)
    inv = torch.full_like(amax, 127.0) / amax
    y = vg * torch.where(amax > 0, inv, torch.zeros_like(amax))
    q = (torch.sign(y) * torch.floor(y.abs() + 0.5)).clamp(-127, 127)
    return (q * (amax / 127.0)).reshape(v.shape).double()


def qact_reference(x, w13, w2, slot_ids, weights, g13: int, g2: int) -> torch.Tensor:
    """float64 MoE with the activations of both GEMMs quantised like the kernel (w13 in the plain
    [S, 2I, H] order, already dequantised)."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    xq = qact_roundtrip(x, g13)  # [T, H]
    inter = w2.shape[2]
    for t in range(x.shape[0]):
        for k in range(slot_ids.shape[1]):
            s = int(slot_ids[t, k])
            if s < 0:
                continue
            gu = w13[s].double() @ xq[t]  # [2I]
            a = torch.nn.functional.silu(gu[:inter]) * gu[inter:]  # [I]
            out[t] += float(weights[t, k]) * (w2[s].double() @ qact_roundtrip(a.float(), g2))
    return out


def caps_of(name: str) -> int:
    """The capability bits up to and including ``name`` (narrower ISAs first). AVX2 is every
    x86-64 CI machine's; the wider ISAs are the lent device host's (AVX-512, VNNI, BF16, AMX):
    their tests are marked ``gpu`` (device only) and fail, not skip, on a CPU without them."""
    order = ("avx2", "avx512", "vnni", "bf16", "amx")
    wanted = order[: order.index(name) + 1]
    caps = kernels.cpu_caps(wanted)
    assert caps == sum(kernels.CAPS[n][0] for n in wanted), f"this CPU lacks {name} ({kernels.cpu_caps()})"
    return caps


# NOTE: `gpu` = runs on the device machine, whose host CPU has the AVX-512/AMX paths
DEVICE_HOST = pytest.mark.gpu


@pytest.mark.parametrize(
    "isa,kind",
    [("avx2", "int8-dot avx2"), pytest.param("vnni", "int8-dot avx512-vnni", marks=DEVICE_HOST)],
)
@pytest.mark.parametrize("wdtype", ["int8", "int4"])
@pytest.mark.parametrize("t", [1, 7])
def test_integer_dot_matches_quantised_activation_reference(isa, kind, wdtype, t):
    if kernels.load() is None:
        pytest.fail("the C kernel did not build on a machine with a C compiler (see the log)")
    h, i = 128, 64  # noqa: E741
    x, w13, w2, slot_ids, weights = inputs(t, torch.float32, seed=200 + t, h=h, i=i)
    b = CpuExpertBackend(threads=2, weight_dtype=wdtype, group=64, caps=caps_of(isa))
    p13, p2 = b.pack_weights(w13, w2)
    assert b.dot_kind() == kind
    out = b.forward(x, p13, p2, slot_ids, weights)
    assert b.fmt is not None
    d13, d2 = unpack_reference(b.fmt, p13, p2)
    ref = qact_reference(x, d13, d2, slot_ids, weights, b.fmt.g13, b.fmt.g2)
    assert rel(out, ref) < 1e-3, rel(out, ref)
    exact = torch_moe(x.double(), d13.double(), d2.double(), slot_ids, weights.double())
    assert rel(out, exact) < 3e-2, rel(out, exact)
    # the exact (fp32) path stays available and matches the dequantised reference
    b.qact = False
    assert b.dot_kind() != kind and rel(b.forward(x, p13, p2, slot_ids, weights), exact) < 1e-5


@DEVICE_HOST
def test_bf16_dot_matches_reference():
    caps = caps_of("bf16")
    x, w13, w2, slot_ids, weights = inputs(5, torch.bfloat16, seed=31, h=128, i=64)
    b = CpuExpertBackend(threads=2, caps=caps)
    p13, p2 = b.pack_weights(w13, w2)
    assert b.dot_kind() == "bf16-dot avx512"
    ref = torch_moe(x.double(), w13.double(), w2.double(), slot_ids, weights.double())
    assert rel(b.forward(x, p13, p2, slot_ids, weights), ref) < 1e-2


@DEVICE_HOST
@pytest.mark.parametrize("wdtype", ["bfloat16", "int8", "int4"])
@pytest.mark.parametrize(
    "t", [1, 40, 120]
)  # 1: decode; 40: one token tile per expert; 120: several + padding
def test_amx_matches_reference(wdtype, t):
    """bf16 tiles within bf16 rounding; int8 tiles (activations quantised) as the integer dots."""
    caps = caps_of("amx")
    b = CpuExpertBackend(threads=2, weight_dtype=wdtype, group=64, caps=caps)
    assert b.amx
    check_amx(b, wdtype, t)


def check_amx(b: CpuExpertBackend, wdtype: str, t: int) -> None:
    x, w13, w2, slot_ids, weights = inputs(t, torch.bfloat16, seed=300 + t, h=128, i=64)
    b.gemv_max_tokens = 0  # AMX for every call it covers (int4 decode otherwise takes the VNNI kernel)
    p13, p2 = b.pack_weights(w13, w2)
    assert b.fmt is not None
    out = b.forward(x, p13, p2, slot_ids, weights)
    if b.fmt.quantised:
        w13, w2 = unpack_reference(b.fmt, p13, p2)
        ref = qact_reference(x, w13, w2, slot_ids, weights, b.fmt.g13, b.fmt.g2)
        assert rel(out, ref) < 1e-2, rel(out, ref)  # the bf16 output's rounding dominates here
        exact = torch_moe(x.double(), w13.double(), w2.double(), slot_ids, weights.double())
        assert rel(out, exact) < 3e-2, rel(out, exact)
    else:
        ref = torch_moe(x.double(), w13.double(), w2.double(), slot_ids, weights.double())
        assert rel(out, ref) < 1e-2, rel(out, ref)
    # fp32 activations through the int8 tiles agree with the reference up to a few rounding
    # flips of the intermediate's quantisation (the tiles sum in another order than float64;
    # each flip moves one element by a step, ~1e-4 here; measured 5e-4 at T=120). A wrong scale,
    # group or token is >= 1e-2. Fresh fp32 values: bf16-valued ones sit on rounding ties.
    if b.fmt.quantised:
        x32 = torch.randn(x.shape, generator=torch.Generator().manual_seed(t))
        out32 = b.forward(x32, p13, p2, slot_ids, weights)
        ref32 = qact_reference(x32, w13, w2, slot_ids, weights, b.fmt.g13, b.fmt.g2)
        assert rel(out32, ref32) < 2e-3, rel(out32, ref32)
        # a bf16 server with quantised weights and exact activations: rows dequantised to bf16 tiles
        b.qact = False
        out = b.forward(x, p13, p2, slot_ids, weights)
        assert rel(out, exact) < 1e-2, rel(out, exact)
        b.qact = True


@pytest.fixture(scope="module")
def emulated_amx():
    """The kernel built with the AMX tile instructions emulated in C (EXPERTMESH_AMX_EMULATE)."""
    lib = kernels.load(("EXPERTMESH_AMX_EMULATE",))
    if lib is None:
        pytest.fail("the C kernel did not build on a machine with a C compiler (see the log)")
    return lib


@pytest.mark.parametrize("wdtype", ["bfloat16", "int8", "int4"])
@pytest.mark.parametrize("t", [1, 40, 120])
def test_amx_tile_logic_emulated(emulated_amx, wdtype, t):
    """The AMX kernel's logic (token tiles, both phases, thread ranges, epilogues, group scales) on
    every x86-64 CI machine, the tile instructions emulated; the device run checks the real ones."""
    b = CpuExpertBackend(threads=2, weight_dtype=wdtype, group=64, caps=caps_of("avx2"))
    b.lib, b.caps, b.amx = emulated_amx, b.caps | kernels.CAPS["amx"][0], True
    check_amx(b, wdtype, t)


@pytest.mark.parametrize("group", [64, PER_ROW])
def test_amx_int4_unpack_per_step_equals_per_block(emulated_amx, group):
    """int4 blocks unpacked one k step at a time into an L1 buffer (the default) give the integer
    sums of the whole block unpacked first (AMX_U4_FUSED=0), so the outputs are equal bit for bit."""
    whole = kernels.load(("EXPERTMESH_AMX_EMULATE", "AMX_U4_FUSED=0"))
    assert whole is not None
    x, w13, w2, slot_ids, weights = inputs(120, torch.bfloat16, seed=77, h=256, i=192)
    out = []
    for lib in (emulated_amx, whole):
        b = CpuExpertBackend(threads=2, weight_dtype="int4", group=group, caps=caps_of("avx2"))
        b.lib, b.caps, b.amx, b.gemv_max_tokens = lib, b.caps | kernels.CAPS["amx"][0], True, 0
        p13, p2 = b.pack_weights(w13, w2)
        out.append(b.forward(x, p13, p2, slot_ids, weights))
    d13, d2 = unpack_reference(b.fmt, p13, p2)
    ref = qact_reference(x.float(), d13, d2, slot_ids, weights, b.fmt.g13, b.fmt.g2)
    assert rel(out[0], ref) < 1e-2, rel(out[0], ref)
    assert torch.equal(out[0], out[1])


@pytest.mark.parametrize("group", [64, 128, PER_ROW])
def test_amx_int4_on_bf16_tiles_emulated(emulated_amx, group):
    """int4 on the bf16 tiles (unquantised activations; or every int4 call with AMX_U4_BF16=2):
    each k step dequantised into an L1 buffer through a per-row table of the 16 values gives the
    whole block dequantised first (AMX_U4_FUSED=0) bit for bit, and the weights' bf16 rounding
    and the activations' are the only error (against float64 on the dequantised weights)."""
    whole = kernels.load(("EXPERTMESH_AMX_EMULATE", "AMX_U4_FUSED=0"))
    every = kernels.load(("EXPERTMESH_AMX_EMULATE", "AMX_U4_BF16=2"))
    assert whole is not None and every is not None
    x, w13, w2, slot_ids, weights = inputs(120, torch.bfloat16, seed=78, h=256, i=192)
    outs = []
    for lib, qact in ((emulated_amx, False), (whole, False), (every, True)):
        b = CpuExpertBackend(threads=2, weight_dtype="int4", group=group, caps=caps_of("avx2"))
        b.lib, b.caps, b.amx, b.gemv_max_tokens = lib, b.caps | kernels.CAPS["amx"][0], True, 0
        b.qact = qact
        p13, p2 = b.pack_weights(w13, w2)
        outs.append(b.forward(x, p13, p2, slot_ids, weights))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    d13, d2 = unpack_reference(b.fmt, p13, p2)
    exact = torch_moe(x.double(), d13.double(), d2.double(), slot_ids, weights.double())
    rounded = torch_moe(
        x.double(), d13.bfloat16().double(), d2.bfloat16().double(), slot_ids, weights.double()
    )
    # measured 2.4e-3 / 3.7e-3 (the bf16 output and intermediate); the quantised activations'
    # path is at 1.4e-2 from exact here, a wrong scale or group at > 1e-1
    assert rel(outs[0], rounded) < 5e-3, rel(outs[0], rounded)
    assert rel(outs[0], exact) < 6e-3, rel(outs[0], exact)


@pytest.mark.parametrize("wdtype", ["bfloat16", "int8", "int4"])
@pytest.mark.parametrize("steal", [True, False])
def test_amx_forward_into_keeps_buffers_and_equals_forward(emulated_amx, wdtype, steal):
    """The server's AMX call (bf16 in and out, int32 ids; bf16 read and written by the call's own
    passes, its scratch kept per thread across calls) writes forward()'s result bit for bit, call
    after call, as the kept buffers grow (40 then 120 tokens) and are reused (40 again); with the
    pair buffer (its per-token sums write bf16) and without (AMX_STEAL=0 AMX_LEAN=0: phase 2 sums
    into fp32 rows, converted after)."""
    lib = emulated_amx if steal else kernels.load(("EXPERTMESH_AMX_EMULATE", "AMX_STEAL=0", "AMX_LEAN=0"))
    assert lib is not None
    x, w13, w2, slot_ids, weights = inputs(120, torch.bfloat16, seed=91, h=128, i=64)
    b = CpuExpertBackend(threads=3, weight_dtype=wdtype, group=64, caps=caps_of("avx2"))
    b.lib, b.caps, b.amx, b.gemv_max_tokens = lib, b.caps | kernels.CAPS["amx"][0], True, 0
    p13, p2 = b.pack_weights(w13, w2)
    for t in (40, 120, 40):
        want = b.forward(x[:t], p13, p2, slot_ids[:t], weights[:t])
        out = torch.full((t, 128), 7.0, dtype=torch.bfloat16)
        assert b.forward_into(x[:t], p13, p2, slot_ids[:t].to(torch.int32), weights[:t], out)
        assert torch.equal(out, want), t


def test_amx_uneven_threads_emulated(emulated_amx):
    """More threads than blocks, and H not a multiple of the threads' row ranges."""
    x, w13, w2, slot_ids, weights = inputs(37, torch.bfloat16, seed=401, h=96, i=32)
    b = CpuExpertBackend(threads=7, caps=caps_of("avx2"))
    b.lib, b.caps, b.amx = emulated_amx, b.caps | kernels.CAPS["amx"][0], True
    out = b.forward(x, *b.pack_weights(w13, w2), slot_ids, weights)
    ref = torch_moe(x.double(), w13.double(), w2.double(), slot_ids, weights.double())
    assert rel(out, ref) < 1e-2, rel(out, ref)


def test_split_gate_up_inverts_interleave():
    w13 = torch.randn(1, 2 * 32, 3)  # [S, 2I, H]
    rb = PackedFormat.for_shape("bfloat16", 3, 32).rb
    gate, up = split_gate_up(interleave(w13, rb)[0].t(), rb)  # [H, I] each
    assert torch.equal(gate, w13[0, :32].t()) and torch.equal(up, w13[0, 32:].t())


# ---- the tiled int8/int4 format: blocks of 16 rows, 64-feature steps, scales last ----


@pytest.mark.parametrize("wdtype", ["int8", "int4"])
@pytest.mark.parametrize("g", [64, 128])
def test_tiled_format_holds_the_row_format_values(wdtype, g):
    """The tiled bytes dequantise to exactly what the row format gives, and sit where the C
    kernels read them: step ks of row r of a block at ks * step bytes + r * (step / 16), the
    block's scales after its weights as [groups][16]."""
    w = torch.randn(2, 32, 256)  # [S, R, C]: two blocks of 16 rows
    tiles = quantize_rows(w, wdtype, g)
    rows = quantize_rows(w[:, :5], wdtype, g)  # 5 rows: not a whole block, so the row format
    assert tiles.shape == (2, 32, rows.shape[-1])
    deq = dequantize_rows(tiles, wdtype, 256, g)
    assert torch.equal(deq[:, :5], dequantize_rows(rows, wdtype, 256, g))
    blk = tiles[1, 16:].reshape(-1)  # slot 1, second block
    r, ks = 3, 2
    if wdtype == "int8":
        q = blk[ks * 1024 + r * 64 : ks * 1024 + r * 64 + 64].view(torch.int8).float()
    else:
        b = blk[ks * 512 + r * 32 : ks * 512 + r * 32 + 32]
        q = torch.cat([b & 15, b >> 4]).float() - 8  # features ks*64 + j, then ks*64 + 32 + j
    body = 256 if wdtype == "int8" else 128
    scales = blk[16 * body :].view(torch.float32).view(256 // g, 16)  # [groups, 16 rows]
    assert torch.equal(q * scales[ks * 64 // g, r], deq[1, 16 + r, ks * 64 : ks * 64 + 64])


@pytest.mark.parametrize("wdtype", ["int8", "int4"])
@pytest.mark.parametrize("t", [1, 40, 120])  # 40: ~20 tokens per expert through the decode kernel
def test_tiled_matches_dequantised_reference(use_kernel, wdtype, t):
    """Tiled weights (group 128: two steps per group) through every path of the backend: the
    integer dots (checked against the activation-quantising reference), the fp32 dots and the
    GEMM path (against the dequantised reference to fp32 rounding), the C kernel and torch."""
    h, i = 256, 128  # noqa: E741
    x, w13, w2, slot_ids, weights = inputs(t, torch.float32, seed=400 + t, h=h, i=i)
    b = CpuExpertBackend(
        threads=2, weight_dtype=wdtype, group=128, use_kernel=use_kernel, caps=caps_of("avx2")
    )
    b.gemv_max_tokens = 10**9 if t == 40 else 16  # t=40: the decode kernel; t=120: GEMMs
    p13, p2 = b.pack_weights(w13, w2)
    assert b.fmt is not None and b.fmt.g13 == b.fmt.g2 == 128
    d13, d2 = unpack_reference(b.fmt, p13, p2)
    exact = torch_moe(x.double(), d13.double(), d2.double(), slot_ids, weights.double())
    out = b.forward(x, p13, p2, slot_ids, weights)
    if use_kernel and t <= 40:
        assert b.dot_kind() == "int8-dot avx2"
        ref = qact_reference(x, d13, d2, slot_ids, weights, 128, 128)
        assert rel(out, ref) < 1e-3, rel(out, ref)
        # bf16 activations in and out: the fp32 result rounded once (the kernel converts itself)
        xb = x.bfloat16()
        out_b = b.forward(xb, p13, p2, slot_ids, weights)
        assert out_b.dtype == torch.bfloat16
        assert torch.equal(out_b, b.forward(xb.float(), p13, p2, slot_ids, weights).bfloat16())
        b.qact = False
        out = b.forward(x, p13, p2, slot_ids, weights)
    assert rel(out, exact) < 1e-5, rel(out, exact)


@pytest.mark.parametrize("wdtype", ["int8", "int4"])
@pytest.mark.parametrize("t", [1, 3, 40])  # 1, 3: fused mode quantises privately; 40: shared
def test_tiled_decode_split_modes_agree_bit_for_bit(monkeypatch, wdtype, t):
    """The work splits (EXPERTMESH_QDOT_SPLIT: 1 dynamic, 2 fused, 3 fused + guided, 4 flow: no
    barrier between the phases) hand blocks to other threads and, in the fused modes, let every
    thread quantise small activations itself,
    but each output element is summed in the same order as the static split, so the results are
    equal bit for bit (and the static split matches the activation-quantising reference)."""
    if kernels.load() is None:
        pytest.fail("the C kernel did not build on a machine with a C compiler (see the log)")
    x, w13, w2, slot_ids, weights = inputs(t, torch.float32, seed=600 + t, h=256, i=128)
    b = CpuExpertBackend(threads=3, weight_dtype=wdtype, group=128, caps=caps_of("avx2"))
    b.gemv_max_tokens = 10**9
    p13, p2 = b.pack_weights(w13, w2)
    monkeypatch.setenv("EXPERTMESH_QDOT_SPLIT", "0")
    static = b.forward(x, p13, p2, slot_ids, weights)
    static_b = b.forward(x.bfloat16(), p13, p2, slot_ids, weights)  # bf16 in and out
    assert b.fmt is not None
    d13, d2 = unpack_reference(b.fmt, p13, p2)
    ref = qact_reference(x, d13, d2, slot_ids, weights, 128, 128)
    assert rel(static, ref) < 1e-3, rel(static, ref)
    for mode in ("1", "2", "3", "4"):
        monkeypatch.setenv("EXPERTMESH_QDOT_SPLIT", mode)
        assert torch.equal(b.forward(x, p13, p2, slot_ids, weights), static), mode
        assert torch.equal(b.forward(x.bfloat16(), p13, p2, slot_ids, weights), static_b), mode
    monkeypatch.delenv("EXPERTMESH_QDOT_SPLIT")  # the kernel's default split (mode 3)
    assert torch.equal(b.forward(x, p13, p2, slot_ids, weights), static)


@DEVICE_HOST
@pytest.mark.parametrize("wdtype", ["int8", "int4"])
@pytest.mark.parametrize("t", [1, 5, 40])
def test_tiled_vnni_and_amx_match_reference(wdtype, t):
    """The AVX512-VNNI block kernel and the AMX int8 tiles on tiled weights with group 128 (two
    k steps per group) and up to ~20 tokens per expert, against the activation-quantising
    reference; and the two paths agree with each other."""
    h, i = 256, 128  # noqa: E741
    x, w13, w2, slot_ids, weights = inputs(t, torch.float32, seed=500 + t, h=h, i=i)
    b = CpuExpertBackend(threads=2, weight_dtype=wdtype, group=128, caps=caps_of("amx"))
    p13, p2 = b.pack_weights(w13, w2)
    assert b.fmt is not None and b.dot_kind() == "int8-dot avx512-vnni"
    d13, d2 = unpack_reference(b.fmt, p13, p2)
    ref = qact_reference(x, d13, d2, slot_ids, weights, 128, 128)
    b.amx, b.gemv_max_tokens = False, 10**9
    vnni = b.forward(x, p13, p2, slot_ids, weights)
    assert rel(vnni, ref) < 1e-3, rel(vnni, ref)
    xb = x.bfloat16()  # bf16 in and out: the fp32 result rounded once
    assert torch.equal(
        b.forward(xb, p13, p2, slot_ids, weights),
        b.forward(xb.float(), p13, p2, slot_ids, weights).bfloat16(),
    )
    b.amx, b.gemv_max_tokens = True, 0
    amx = b.forward(x, p13, p2, slot_ids, weights)
    assert rel(amx, ref) < 2e-3, rel(amx, ref)


def test_decode_sized_int_calls_skip_amx_on_amx_hosts(monkeypatch):
    """On an AMX host the default int8/int4 path at decode sizes (a few tokens per
    expert) is the same decode-kernel call as the forced "/kernel" path of the benchmark, so the
    two rows may differ only by timing noise. AMX is pretended here: calling it would fail."""
    if kernels.load() is None:
        pytest.fail("the C kernel did not build on a machine with a C compiler (see the log)")
    x, w13, w2, slot_ids, weights = inputs(1, torch.float32, seed=700, h=256, i=128)
    b = CpuExpertBackend(threads=2, weight_dtype="int8", caps=caps_of("avx2"))
    p13, p2 = b.pack_weights(w13, w2)
    forced = b.forward(x, p13, p2, slot_ids, weights)  # no AMX: the decode kernel
    b.amx = True

    def no_amx(*args, **kwargs):
        raise AssertionError("a decode-sized int8 call went to the AMX kernel")

    monkeypatch.setattr(b, "_amx", no_amx)
    assert torch.equal(b.forward(x, p13, p2, slot_ids, weights), forced)


@DEVICE_HOST
@pytest.mark.parametrize("wdtype", ["int8", "int4"])
@pytest.mark.parametrize("t", [1, 40])
def test_vnni_split_modes_agree_bit_for_bit(monkeypatch, wdtype, t):
    """The AVX512-VNNI block kernel under every work split (EXPERTMESH_QDOT_SPLIT 0-4; 2 and 3
    quantise privately at t=1) with 16 threads: equal bit for bit, and the static split matches
    the activation-quantising reference."""
    x, w13, w2, slot_ids, weights = inputs(t, torch.float32, seed=800 + t, h=256, i=128)
    b = CpuExpertBackend(threads=16, weight_dtype=wdtype, group=64, caps=caps_of("vnni"))
    b.gemv_max_tokens = 10**9
    p13, p2 = b.pack_weights(w13, w2)
    assert b.fmt is not None and b.dot_kind() == "int8-dot avx512-vnni"
    d13, d2 = unpack_reference(b.fmt, p13, p2)
    ref = qact_reference(x, d13, d2, slot_ids, weights, 64, 64)
    monkeypatch.setenv("EXPERTMESH_QDOT_SPLIT", "0")
    static = b.forward(x, p13, p2, slot_ids, weights)
    assert rel(static, ref) < 1e-3, rel(static, ref)
    for mode in ("1", "2", "3", "4"):
        monkeypatch.setenv("EXPERTMESH_QDOT_SPLIT", mode)
        for _ in range(3):  # dynamic splits differ from call to call
            assert torch.equal(b.forward(x, p13, p2, slot_ids, weights), static), mode


@DEVICE_HOST
@pytest.mark.parametrize("t", [1, 2, 3, 5, 40])
@pytest.mark.parametrize("h,i", [(256, 128), (384, 128)])
@pytest.mark.parametrize("wdtype,group", [("int4", 64), ("int8", 128), ("int8", 64)])
def test_vnni_pair_loops_equal_avx2_bit_for_bit(monkeypatch, t, h, i, wdtype, group):  # noqa: E741
    """The AVX512-VNNI block loops (int4 with groups of 64: both nibbles as 16x, one
    accumulator per row pair; int8: two tokens per weight load, half a block at a time, and a
    constant trip count for groups of 128) compute the integer sums of the AVX2 loop and of the
    previous VNNI loops (EXPERTMESH_QDOT_PAIR=0), so the outputs are equal bit for bit; 1 to 40
    tokens over 4 experts give 1, 2 and odd numbers of tokens per expert and block."""
    x, w13, w2, slot_ids, weights = inputs(t, torch.float32, seed=1400 + t, h=h, i=i)
    slot_ids = torch.randint(0, 4, slot_ids.shape, generator=torch.Generator().manual_seed(t))
    out = {}
    for isa in ("avx2", "vnni"):
        b = CpuExpertBackend(threads=16, weight_dtype=wdtype, group=group, caps=caps_of(isa))
        b.gemv_max_tokens = 10**9  # the decode kernel at every t
        p13, p2 = b.pack_weights(w13, w2)
        assert b.fmt is not None and (b.fmt.g13, b.fmt.g2) == (group, group)
        for pair in ("1", "0"):
            monkeypatch.setenv("EXPERTMESH_QDOT_PAIR", pair)
            out[isa, pair] = b.forward(x, p13, p2, slot_ids, weights)
    d13, d2 = unpack_reference(b.fmt, p13, p2)
    ref = qact_reference(x, d13, d2, slot_ids, weights, group, group)
    assert rel(out["vnni", "1"], ref) < 1e-3, rel(out["vnni", "1"], ref)
    for key, o in out.items():
        assert torch.equal(o, out["avx2", "0"]), key


@pytest.mark.parametrize("caps", ["avx2", pytest.param("vnni", marks=DEVICE_HOST)])
@pytest.mark.parametrize("wdtype", ["int8", "int4"])
@pytest.mark.parametrize("t", [1, 3, 40])
def test_decode_prefetch_chain_and_claims_agree_bit_for_bit(monkeypatch, caps, wdtype, t):
    """Phase 2's prefetch chained into the next expert's block
    (EXPERTMESH_QDOT_CHAIN) and phase 2 blocks claimed and prefetched by threads that finish
    phase 1 early (EXPERTMESH_QDOT_CLAIM) change only which thread reads what when, and the
    AVX-512 activation quantisation (VNNI) gives the scalar one's bytes: every split mode's
    result equals the static split's with the scalar quantisation bit for bit, with 16 threads
    (claims happen only while other threads still run phase 1) and bf16 in and out."""
    if kernels.load() is None:
        pytest.fail("the C kernel did not build on a machine with a C compiler (see the log)")
    x, w13, w2, slot_ids, weights = inputs(t, torch.float32, seed=900 + t, h=256, i=128)
    b = CpuExpertBackend(threads=16, weight_dtype=wdtype, group=64, caps=caps_of(caps))
    b.gemv_max_tokens = 10**9
    p13, p2 = b.pack_weights(w13, w2)
    monkeypatch.setenv("EXPERTMESH_QDOT_SPLIT", "0")
    monkeypatch.setenv("EXPERTMESH_QDOT_CHAIN", "0")
    monkeypatch.setenv("EXPERTMESH_QDOT_CLAIM", "0")
    monkeypatch.setenv("EXPERTMESH_QDOT_Q512", "0")  # the scalar activation quantisation
    static = b.forward(x, p13, p2, slot_ids, weights)
    static_b = b.forward(x.bfloat16(), p13, p2, slot_ids, weights)
    assert b.fmt is not None
    d13, d2 = unpack_reference(b.fmt, p13, p2)
    assert rel(static, qact_reference(x, d13, d2, slot_ids, weights, 64, 64)) < 1e-3
    monkeypatch.delenv("EXPERTMESH_QDOT_Q512")  # AVX-512 where the dots are VNNI: the same bytes
    for mode, chain, claim in (
        ("0", "1", "0"),
        ("1", "1", "0"),
        ("3", "1", "4"),
        ("2", "0", "16"),
        ("4", "1", "2"),
        ("5", "0", "0"),
        ("5", "1", "3"),
        ("", "", ""),  # the kernel's defaults
    ):
        for var, value in (("SPLIT", mode), ("CHAIN", chain), ("CLAIM", claim)):
            if value:
                monkeypatch.setenv(f"EXPERTMESH_QDOT_{var}", value)
            else:
                monkeypatch.delenv(f"EXPERTMESH_QDOT_{var}")
        for _ in range(3):  # who claims what differs from call to call
            assert torch.equal(b.forward(x, p13, p2, slot_ids, weights), static), (mode, chain, claim)
        assert torch.equal(b.forward(x.bfloat16(), p13, p2, slot_ids, weights), static_b), (
            mode,
            chain,
            claim,
        )


@pytest.mark.parametrize("wdtype", ["int8", "int4"])
def test_decode_fast_path_matches_the_general_dispatch(monkeypatch, wdtype):
    """Decode-sized int8/int4 calls go straight to moe_decode_qa (the arguments in one
    int64 block) with the general path's (``_decode`` -> moe_decode_a's integer dots) result bit for bit; what
    it does not take (bf16 routing weights, a non-contiguous x, more tokens per expert than the
    limit) goes the general way; int32 ids (the wire's) take it too (the kernel
    widens them); a bad slot id is still a ValueError."""
    if kernels.load() is None:
        pytest.fail("the C kernel did not build on a machine with a C compiler (see the log)")
    x, w13, w2, slot_ids, weights = inputs(3, torch.float32, seed=950, h=256, i=128)
    b = CpuExpertBackend(threads=2, weight_dtype=wdtype, group=64, caps=caps_of("avx2"))
    p13, p2 = b.pack_weights(w13, w2)
    code = kernels.WDTYPE_CODE[wdtype]
    assert b._qdec_limit() == GEMV_MAX_TOKENS
    calls = []
    real = b._run

    def spy(kind, block):  # the calls handed to moe_decode_qa (on the kernel thread)
        if kind == kernels.KT_QA:
            calls.append(len(block))
        return real(kind, block)

    monkeypatch.setattr(b, "_run", spy)
    for xx in (x, x.bfloat16()):
        for ids in (slot_ids, slot_ids.int()):
            fast = b.forward(xx, p13, p2, ids, weights)
            assert calls.pop() == _QARGS.size and fast.dtype == xx.dtype
            assert torch.equal(fast, b._decode(xx, p13, p2, slot_ids, weights, code))
    wide = torch.cat([x, x], dim=1)[:, :256]  # [T, H], not contiguous
    for args in ((x, slot_ids, weights.bfloat16()), (wide, slot_ids, weights)):
        out = b.forward(args[0], p13, p2, args[1], args[2])
        assert not calls
        assert torch.equal(out, b._decode(args[0], p13, p2, args[1], args[2], code))
    with pytest.raises(ValueError, match="slot ids"):
        b.forward(x, p13, p2, slot_ids.clamp(min=0) + S, weights)
    assert calls.pop() == _QARGS.size
    assert torch.equal(b.forward(x, p13, p2, slot_ids[:, :0], weights[:, :0]), torch.zeros_like(x))  # K = 0
    calls.clear()
    b.gemv_max_tokens = 1  # 3 tokens x 3 experts over 6 slots: 1.5 per expert, past the limit
    b.forward(x, p13, p2, slot_ids, weights)
    assert b._qdec_limit() == 1 and not calls


@pytest.mark.parametrize("wdtype", ["int8", "int4"])
def test_int_prefill_without_amx_stays_in_the_decode_kernel(monkeypatch, wdtype):
    """Without AMX, int8/int4 on integer dots serve up to GEMV_INT_MAX_TOKENS tokens
    per expert with the decode kernel (against the activation-quantising reference), above that
    the dequantise + GEMM path (against the dequantised reference); a forced gemv_max_tokens, AMX,
    qact=False and groups without integer dots keep the old limit."""
    if kernels.load() is None:
        pytest.fail("the C kernel did not build on a machine with a C compiler (see the log)")
    h, i = 256, 128  # noqa: E741
    x, w13, w2, slot_ids, weights = inputs(200, torch.float32, seed=800, h=h, i=i)
    b = CpuExpertBackend(threads=2, weight_dtype=wdtype, group=128, caps=caps_of("avx2"))
    p13, p2 = b.pack_weights(w13, w2)
    assert b.fmt is not None and b.dot_kind() == "int8-dot avx2"
    assert b.gemv_limit() == GEMV_INT_MAX_TOKENS == 48
    d13, d2 = unpack_reference(b.fmt, p13, p2)

    def refuse(path: str):
        def call(*args, **kwargs):
            raise AssertionError(f"the call went to {path}")

        return call

    # 90 tokens x 3 picks over 6 slots: 45 per expert, the decode kernel
    t = 90
    xs, sid, wts = x[:t], slot_ids[:t], weights[:t]
    with monkeypatch.context() as m:
        m.setattr(b, "_by_expert", refuse("_by_expert"))
        out = b.forward(xs, p13, p2, sid, wts)
    ref = qact_reference(xs, d13, d2, sid, wts, 128, 128)
    assert rel(out, ref) < 1e-3, rel(out, ref)
    b.gemv_max_tokens = GEMV_MAX_TOKENS  # forced: the GEMMs, to fp32 rounding
    exact = torch_moe(xs.double(), d13.double(), d2.double(), sid, wts.double())
    assert rel(b.forward(xs, p13, p2, sid, wts), exact) < 1e-5
    # 200 tokens: 100 per expert, past the limit: the GEMMs
    b.gemv_max_tokens = None
    with monkeypatch.context() as m:
        m.setattr(b, "_decode", refuse("_decode"))
        out = b.forward(x, p13, p2, slot_ids, weights)
    exact = torch_moe(x.double(), d13.double(), d2.double(), slot_ids, weights.double())
    assert rel(out, exact) < 1e-5, rel(out, exact)
    b.caps = sum(kernels.CAPS[n][0] for n in ("avx2", "avx512", "vnni"))  # only asked, never run
    assert b.dot_kind() == "int8-dot avx512-vnni" and b.gemv_limit() == GEMV_MAX_TOKENS  # unmeasured
    b.caps = caps_of("avx2")
    b.amx = True  # AMX hosts: dispatch unchanged
    assert b.gemv_limit() == GEMV_MAX_TOKENS
    b.amx, b.qact = False, False
    assert b.gemv_limit() == GEMV_MAX_TOKENS
    g32 = CpuExpertBackend(threads=2, weight_dtype=wdtype, group=32, caps=caps_of("avx2"))
    g32.pack_weights(w13, w2)
    assert g32.dot_kind() == "fp32" and g32.gemv_limit() == GEMV_MAX_TOKENS


@pytest.mark.parametrize("wdtype", ["bfloat16", "int8"])
def test_amx_stealing_changes_nothing_emulated(emulated_amx, wdtype):
    """Prefill-shaped calls: threads that end their range take items from the others'
    and phase 2 goes through the pair buffer; the result is bit-equal to the plain static split
    (same per-block arithmetic, same per-token summation order) and to the reference's tolerance."""
    plain = kernels.load(("EXPERTMESH_AMX_EMULATE", "AMX_STEAL=0"))
    assert plain is not None
    x, w13, w2, slot_ids, weights = inputs(150, torch.bfloat16, seed=402, h=128, i=64)
    outs = []
    for lib in (emulated_amx, plain):
        b = CpuExpertBackend(threads=5, weight_dtype=wdtype, group=64, caps=caps_of("avx2"))
        b.lib, b.caps, b.amx = lib, b.caps | kernels.CAPS["amx"][0], True
        b.gemv_max_tokens = 0
        outs.append(b.forward(x, *b.pack_weights(w13, w2), slot_ids, weights))
    assert torch.equal(outs[0], outs[1])
    ref = torch_moe(x.double(), w13.double(), w2.double(), slot_ids, weights.double())
    assert rel(outs[0], ref) < 3e-2, rel(outs[0], ref)


@pytest.mark.parametrize("wdtype,group", [("int4", 64), ("int4", 128), ("int4", PER_ROW), ("int8", 128)])
def test_amx_signed_int4_and_lagged_fold_change_nothing_emulated(emulated_amx, wdtype, group):
    """int4 unpacked to 16 q on the signed tile instruction (no per-token correction; the 16 in the
    token scales), and each group's sums folded after the next group's products are issued, give
    bit for bit the builds with nibbles 0..15 on the unsigned instruction (AMX_U4_S16=0), the
    whole block unpacked first (AMX_U4_FUSED=0), each group folded at once (AMX_FOLD_LAG=0), two
    groups folded a pass (AMX_FOLD_NG=2), the results transposed by scalar copies (AMX_VT=0), and
    the intermediates quantised in a pass of their own (AMX_Q2_FUSED=0) rather than by each
    phase-1 item, and every pair of token tiles run as a pass of its own (AMX_MT=2) or passes of
    at most three tiles (AMX_MT=3: a 4-tile expert as 2 + 2) rather than an expert's tiles group by
    group; experts get 2-4 token tiles (blocks of two tiles and of one)."""
    defines = (
        *(("AMX_U4_S16=0",), ("AMX_U4_FUSED=0",), ("AMX_FOLD_LAG=0",), ("AMX_FOLD_NG=2",), ("AMX_VT=0",)),
        ("AMX_Q2_FUSED=0",),
        ("AMX_MT=2",),
        ("AMX_MT=3",),
    )
    builds = [kernels.load(("EXPERTMESH_AMX_EMULATE", *d)) for d in defines]
    assert None not in builds
    x, w13, w2, slot_ids, weights = inputs(120, torch.bfloat16, seed=404, h=384, i=128)
    outs = []
    for lib in (emulated_amx, *builds):
        b = CpuExpertBackend(threads=3, weight_dtype=wdtype, group=group, caps=caps_of("avx2"))
        b.lib, b.caps, b.amx, b.gemv_max_tokens = lib, b.caps | kernels.CAPS["amx"][0], True, 0
        p13, p2 = b.pack_weights(w13, w2)
        outs.append(b.forward(x, p13, p2, slot_ids, weights))
    for d, out in zip(defines, outs[1:]):
        assert torch.equal(outs[0], out), d
    d13, d2 = unpack_reference(b.fmt, p13, p2)
    ref = qact_reference(x.float(), d13, d2, slot_ids, weights, b.fmt.g13, b.fmt.g2)
    assert rel(outs[0], ref) < 1e-2, rel(outs[0], ref)


@pytest.mark.parametrize("wdtype", ["bfloat16", "int8"])
@pytest.mark.parametrize("t", [1, 5])
def test_amx_lean_decode_split_changes_nothing_emulated(emulated_amx, wdtype, t):
    """Decode-shaped calls: the tokens gathered by the calling thread and both phases split by
    ranges with stealing (phase 2 through the pair buffer) give the dynamic split's result bit for
    bit (AMX_LEAN=0), with some pairs routed elsewhere (-1) and a call with none here."""
    dynamic = kernels.load(("EXPERTMESH_AMX_EMULATE", "AMX_LEAN=0"))
    assert dynamic is not None
    x, w13, w2, slot_ids, weights = inputs(t, torch.bfloat16, seed=403 + t, h=128, i=64)
    slot_ids = torch.where(slot_ids % 3 == 0, -1, slot_ids)  # a server holding some of the experts
    nowhere = torch.full_like(slot_ids, -1)
    outs, empty = [], []
    for lib in (emulated_amx, dynamic):
        b = CpuExpertBackend(threads=5, weight_dtype=wdtype, group=64, caps=caps_of("avx2"))
        b.lib, b.caps, b.amx, b.gemv_max_tokens = lib, b.caps | kernels.CAPS["amx"][0], True, 0
        p13, p2 = b.pack_weights(w13, w2)
        outs.append(b.forward(x, p13, p2, slot_ids, weights))
        empty.append(b.forward(x, p13, p2, nowhere, weights))
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(empty[0], empty[1]) and not empty[0].any()
    ref = torch_moe(x.double(), w13.double(), w2.double(), slot_ids, weights.double())
    assert rel(outs[0], ref) < 3e-2, rel(outs[0], ref)


@pytest.mark.parametrize("caps", ["avx2", pytest.param("vnni", marks=DEVICE_HOST)])
@pytest.mark.parametrize("wdtype", ["int8", "int4"])
@pytest.mark.parametrize("t", [1, 3])
def test_forward_into_writes_forwards_result_into_the_given_tensor(caps, wdtype, t):
    """The fast paths' call (routing as the wire brings it: int32 ids, float32
    weights; the kernel widens the ids) writes forward()'s result bit for bit into a given bf16
    or fp32 tensor and says so (bf16 x into fp32 declined: forward rounds to bf16 first); int64
    ids too; a call it does not take (bf16 weights,
    prefill-sized, a strided or mismatched out, non-float32 routing weights, strided ids)
    returns False and leaves out untouched; a bad slot id is a ValueError."""
    if kernels.load() is None:
        pytest.fail("the C kernel did not build on a machine with a C compiler (see the log)")
    x, w13, w2, slot_ids, weights = inputs(t, torch.float32, seed=1500 + t, h=256, i=128)
    b = CpuExpertBackend(threads=4, weight_dtype=wdtype, group=64, caps=caps_of(caps))
    p13, p2 = b.pack_weights(w13, w2)
    ids32 = slot_ids.to(torch.int32)
    for xin in (x, x.bfloat16()):
        want = b.forward(xin, p13, p2, slot_ids, weights)  # the dispatch's own choice: the decode kernel
        for odt in (torch.bfloat16, torch.float32):
            for ids in (ids32, slot_ids):
                out = torch.full(xin.shape, 7.0, dtype=odt)
                if (xin.dtype, odt) == (torch.bfloat16, torch.float32):  # forward rounds to bf16 first
                    assert not b.forward_into(xin, p13, p2, ids, weights, out) and bool((out == 7).all())
                    continue
                assert b.forward_into(xin, p13, p2, ids, weights, out)
                assert torch.equal(out, want.to(odt))
    out = torch.full(x.shape, 7.0)
    strided = torch.full((t, 512), 7.0)[:, ::2]
    assert not b.forward_into(x, p13, p2, ids32, weights.half(), out)
    assert not b.forward_into(x, p13, p2, torch.cat([ids32, ids32], 1)[:, ::2], weights, out)
    assert not b.forward_into(x, p13, p2, ids32, weights, strided) and bool((strided == 7).all())
    assert not b.forward_into(x, p13, p2, ids32, weights, torch.full((t + 1, 256), 7.0))
    many = torch.randint(0, S, (64, K), dtype=torch.int32)  # 64 tokens: past the decode limit
    assert not b.forward_into(torch.randn(64, 256), p13, p2, many, torch.rand(64, K), torch.empty(64, 256))
    assert bool((out == 7).all())
    bad = ids32.clone()
    bad[0, 0] = S
    with pytest.raises(ValueError, match="slot ids outside"):
        b.forward_into(x, p13, p2, bad, weights, out)
    bf = CpuExpertBackend(threads=4, weight_dtype="bfloat16", caps=caps_of(caps))
    q13, q2 = bf.pack_weights(w13, w2)
    assert not bf.forward_into(x, q13, q2, ids32, weights, out) and bool((out == 7).all())


@pytest.mark.parametrize("amx", ["emulated", pytest.param("real", marks=DEVICE_HOST)])
@pytest.mark.parametrize("wdtype", ["bfloat16", "int8", "int4"])
@pytest.mark.parametrize("t", [1, 40])
def test_forward_into_amx_calls_match_forward(emulated_amx, amx, wdtype, t):
    """Forward_into takes the calls forward() sends to AMX (bf16 weights at every size,
    int8/int4 past the decode kernel's limit) through one moe_amx_a call that converts in C: the
    result equals forward()'s bit for bit in every x / ids / out dtype combination (the fp32
    result rounded to bf16 as torch rounds it)."""
    x, w13, w2, slot_ids, weights = inputs(t, torch.float32, seed=1700 + t, h=128, i=64)
    w13, w2 = w13.bfloat16(), w2.bfloat16()  # a checkpoint's weights, as the slot table reads them
    if amx == "emulated":
        b = CpuExpertBackend(threads=3, weight_dtype=wdtype, group=64, caps=caps_of("avx2"))
        b.lib, b.caps, b.amx = emulated_amx, b.caps | kernels.CAPS["amx"][0], True
    else:
        b = CpuExpertBackend(threads=16, weight_dtype=wdtype, group=64, caps=caps_of("amx"))
        assert b.amx
    p13, p2 = b.pack_weights(w13, w2)
    for xin in (x.bfloat16(), x) if wdtype != "bfloat16" else (x.bfloat16(),):
        want = b.forward(xin, p13, p2, slot_ids, weights)
        for ids in (slot_ids.to(torch.int32), slot_ids):
            for odt in (torch.bfloat16, torch.float32):
                out = torch.full(xin.shape, 7.0, dtype=odt)
                took = b.forward_into(xin, p13, p2, ids, weights, out)
                assert took == ((xin.dtype, odt) != (torch.bfloat16, torch.float32)), (xin.dtype, odt)
                assert torch.equal(out, want.to(odt)) if took else bool((out == 7).all())
    if wdtype == "bfloat16":  # fp32 activations on bf16 weights are not an AMX call: forward's
        assert not b.forward_into(x, p13, p2, slot_ids, weights, torch.empty_like(x))


def test_worker_fast_path_answers_int4_through_forward_into(monkeypatch):
    """The worker's fast-path call (ExpertWorker.forward_into, the shm ring as ``into``) on an
    int4 CPU backend takes the backend's forward_into (no forward(), no copy) and answers what
    the gRPC path (worker.compute -> forward) answers."""
    if kernels.load() is None:
        pytest.fail("the C kernel did not build on a machine with a C compiler (see the log)")
    from types import SimpleNamespace

    from expertmesh.worker.core import ExpertWorker, WorkerIdentity
    from expertmesh.worker.slots import SlotTable
    from expertmesh.worker_api import ExpertRequest

    x, w13, w2, _, _ = inputs(1, torch.float32, seed=1600, h=256, i=128)

    class Reader:
        config = SimpleNamespace(hidden_size=256, moe_intermediate_size=128, moe_layer_ids=[0], num_experts=S)

        def expert_weights(self, layer: int, e: int) -> SimpleNamespace:
            return SimpleNamespace(w13=w13[e], w2=w2[e])

    b = CpuExpertBackend(threads=2, weight_dtype="int4", group=64, caps=caps_of("avx2"))
    slots = SlotTable(Reader(), torch.float32, torch.device("cpu"), S, b.pack_weights)  # type: ignore[arg-type]
    slots.preload(list(range(S)))
    worker = ExpertWorker(slots, b, WorkerIdentity("cpu", "cpu", "host"))
    g = torch.Generator().manual_seed(5)
    req = ExpertRequest(
        1, 0, 0, torch.randn(2, 256, generator=g), torch.randint(-1, S, (2, K), generator=g, dtype=torch.int32),
        torch.rand(2, K, generator=g),
    )  # fmt: skip
    want = worker.compute(worker.check(req))
    calls = []
    monkeypatch.setattr(b, "forward", lambda *a, **k: calls.append(a))  # must not be needed
    ring = torch.full((2, 256), 7.0)
    worker.forward_into(req, ring)
    assert not calls and torch.equal(ring, want)
    assert (
        worker.stats.requests == 2 and worker.tokens_per_slot[0].sum() == int((req.slot_ids >= 0).sum()) * 2
    )


def _threads_started_by_kernels(kernel_thread: bool, callers: int = 3) -> int:
    """Threads this process gained when ``callers`` Python threads each ran one bf16 decode call
    of a 2-thread backend and stayed alive (libgomp keeps a thread's team as long as the thread
    lives), not counting the callers themselves."""
    b = CpuExpertBackend(threads=2, weight_dtype="bfloat16", kernel_thread=kernel_thread)
    x, w13, w2, slot_ids, weights = inputs(1, torch.float32, seed=990, h=128, i=64)
    p13, p2 = b.pack_weights(w13, w2)
    before = set(os.listdir("/proc/self/task"))
    called, leave = threading.Barrier(callers + 1), threading.Event()
    ids: list[str] = []
    outs: list[torch.Tensor] = []

    def call() -> None:
        ids.append(str(threading.get_native_id()))
        outs.append(b.forward(x, p13, p2, slot_ids, weights))
        called.wait(30)
        leave.wait(30)

    threads = [threading.Thread(target=call) for _ in range(callers)]
    for t in threads:
        t.start()
    try:
        called.wait(30)
        started = set(os.listdir("/proc/self/task")) - before - set(ids)
    finally:
        leave.set()
        for t in threads:
            t.join(30)
    assert len(outs) == callers and all(torch.equal(o, outs[0]) for o in outs)
    return len(started)


def test_kernels_start_from_one_thread_whichever_thread_calls():
    """A backend starts every kernel from its one kernel thread: calls from three Python threads
    add that thread and its OpenMP team's one worker (2 threads), where calling from each thread
    (``kernel_thread=False``, the control) adds a team per calling thread: libgomp's teams,
    which throttle each other once they outnumber the CPUs (benchmarks/bench_omp_teams.py)."""
    if kernels.load() is None:
        pytest.fail("the C kernel did not build on a machine with a C compiler (see the log)")
    # NOTE: the fewest of two tries: a thread another test left running may start one meanwhile
    assert min(_threads_started_by_kernels(True) for _ in range(2)) == 2
    assert min(_threads_started_by_kernels(False) for _ in range(2)) == 3


def test_per_row_group_is_each_width():
    """--weight-group row: one scale per row of each matrix, whatever its width; None keeps the
    dtype's default, a number the largest group <= it that divides the width."""
    row, default = (
        PackedFormat.for_shape("int4", 2048, 768, PER_ROW),
        PackedFormat.for_shape("int4", 2048, 768),
    )
    assert (row.g13, row.g2) == (2048, 768) and (default.g13, default.g2) == (64, 64)
    assert PackedFormat.for_shape("int8", 2048, 1408, 100).g2 == 88  # 1408 = 16 * 88
    assert PackedFormat.for_shape("bfloat16", 2048, 768, PER_ROW).g13 == 1


@pytest.mark.parametrize(
    "isa", ["avx2", pytest.param("vnni", marks=DEVICE_HOST), pytest.param("amx", marks=DEVICE_HOST)]
)
@pytest.mark.parametrize("wdtype", ["int8", "int4"])
@pytest.mark.parametrize("t", [1, 7, 40])
def test_per_row_scales_match_quantised_activation_reference(isa, wdtype, t):
    """One scale per row (widths 256 and 192: one group of each, tiled) through the decode
    kernel's integer dots and, with AMX, the int8 tiles, which fold their integer sums once per
    row: equal to the reference that quantises activations per token over the whole row."""
    h, i = 256, 192  # noqa: E741
    x, w13, w2, slot_ids, weights = inputs(t, torch.float32, seed=500 + t, h=h, i=i)
    b = CpuExpertBackend(threads=2, weight_dtype=wdtype, group=PER_ROW, caps=caps_of(isa))
    p13, p2 = b.pack_weights(w13, w2)
    assert b.fmt is not None and (b.fmt.g13, b.fmt.g2) == (h, i)
    if isa == "amx":
        assert b.amx
        b.gemv_max_tokens = 0  # the tiles for every call
    else:
        b.gemv_max_tokens = 10**9  # the integer dots at every t (past the limit: float GEMMs)
    out = b.forward(x, p13, p2, slot_ids, weights)
    d13, d2 = unpack_reference(b.fmt, p13, p2)
    ref = qact_reference(x, d13, d2, slot_ids, weights, h, i)
    assert rel(out, ref) < 1e-3, rel(out, ref)
