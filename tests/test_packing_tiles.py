"""The CPU backend's load-time quantiser: the tiled int8/int4 bytes written in one pass, a few
rows at a time, are exactly the row format rearranged into tiles (packing.py's two-step
definition, whose placement test_cpu_backend.py checks against the C kernels' layout), and the
per-group maxima read from the float bits equal torch's ``abs().amax()``."""

from __future__ import annotations

import pytest
import torch

from cpu_expert_server import packing


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("g", [64, 128])
@pytest.mark.parametrize("wdtype", ["int8", "int4"])
def test_one_pass_tiles_equal_row_format_then_tiles(monkeypatch, wdtype, g, dtype):
    torch.manual_seed(0)
    # [S, R, C] with rows of very different scales and an all-zero group
    w = (torch.randn(3, 48, 256) * torch.rand(3, 48, 1) * 4).to(dtype)
    w[0, 0, :g] = 0
    # blocks of 16 rows: a block boundary inside each matrix and across slots
    monkeypatch.setattr(packing, "_BLOCK_BYTES", 16 * 4 * 256)
    got = packing.quantize_rows(w, wdtype, g)
    want = packing._to_tiles(packing._quantize(w, wdtype, g), wdtype, 256, g)
    assert got.shape == want.shape and torch.equal(got, want)


def test_row_format_levels_follow_the_definition():
    """``w = q * s`` with ``s = max|w| / 7`` per group and ``q = round(w / s)`` in [-8, 7],
    low nibble element j, high nibble element j + G/2 (the module docstring), from bf16."""
    torch.manual_seed(1)
    w = torch.randn(5, 128).bfloat16()  # 5 rows: the row format
    rows = packing.quantize_rows(w, "int4", 64)
    wf = w.float().view(5, 2, 64)
    s = wf.abs().amax(-1) / 7  # [5, 2]
    q = torch.round(wf / s[..., None]).clamp(-8, 7) + 8  # [5, 2, 64] in 0..15
    body = (q[..., :32] + 16 * q[..., 32:]).to(torch.uint8).view(5, 64)
    assert torch.equal(rows[:, :64], body)
    assert torch.equal(rows[:, 64:].contiguous().view(torch.float32), s)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_group_maxima_from_the_bits(dtype):
    info = torch.finfo(dtype)
    special = [0.0, -0.0, info.tiny / 4, -info.tiny, info.max, -info.max, float("inf"), -float("inf"), 1.0]
    w = torch.randn(4, 8, 16).to(dtype)
    w.view(-1)[: len(special)] = torch.tensor(special).to(dtype)
    w[3, 2] = -torch.rand(16).to(dtype)  # a group of negatives only
    w[3, 3] = 0.0
    assert torch.equal(packing._absmax(w), w.abs().amax(-1).float())


@pytest.mark.parametrize("wdtype", ["int8", "int4"])
def test_into_a_slot_with_reused_scratch_equals_fresh(monkeypatch, wdtype):
    """Without the C quantiser a load quantises each expert straight into its slot with one
    thread's buffers reused expert after expert (two widths alternating, a last block shorter
    than the others): the same bytes as the two-step definition, and the scratch asked for
    only once per buffer."""
    torch.manual_seed(2)
    monkeypatch.setattr(packing, "_BLOCK_BYTES", 32 * 4 * 256)  # 48 rows: blocks of 32 and 16
    bufs: dict[tuple, torch.Tensor] = {}

    def scratch(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        key = (name, shape, dtype)
        if key not in bufs:
            bufs[key] = torch.full(shape, 7, dtype=dtype)  # stale contents must not matter
        return bufs[key]

    slots = {c: torch.zeros(3, 48, packing.quantize_rows(torch.zeros(48, c), wdtype, 64).shape[-1],
                            dtype=torch.uint8) for c in (256, 128)}  # fmt: skip
    for s in range(3):
        for c in (256, 128):
            w = (torch.randn(48, c) * (s + 1)).bfloat16()
            got = packing.quantize_rows_torch(w, wdtype, 64, slots[c][s], scratch)
            assert got.data_ptr() == slots[c][s].data_ptr()
            want = packing._to_tiles(packing._quantize(w, wdtype, 64), wdtype, c, 64)
            assert torch.equal(slots[c][s], want)
    assert len(bufs) == 2 * (5 if wdtype == "int4" else 4)  # bits, max, scale, codes (+ pairs) per width
