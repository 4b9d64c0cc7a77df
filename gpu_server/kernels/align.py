"""Token-to-slot alignment: the (token, k) pairs sorted by local slot into blocks of BLOCK_M rows.

The grouped GEMMs work on blocks of BLOCK_M rows that all belong to one slot. Each slot's pairs
occupy a run of rows starting at a multiple of BLOCK_M, padded up to the next multiple; pairs
whose slot is -1 get no row. Three small launches, no host synchronisation (CUDA-graph safe);
at decode sizes the three phases run in one program instead (one launch, no memset):

    count    per-slot pair counts (atomics)
    map      padded starts per slot, and the slot of every block (-1 past the last used block)
    scatter  each pair's row = its slot's start + a rank drawn from a per-slot atomic cursor

Rows inside a slot come in no fixed order; that changes no result, since every row of a matrix
product is computed independently of the rows beside it. Padding rows of ``sorted_pairs`` are
never written: readers mask them with ``row - slot_start < slot_count``.

Shapes: T tokens, K top-k, S local slots, P = T*K pairs, R = max_rows, B = max_blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

_PAIR_BLOCK = 1024  # pairs per program in the count and scatter kernels
_MAP_BLOCKS = 64  # blocks per program in the map kernel

# NOTE: Triton compiles a variant per integer argument that is 1 or a multiple of 16 unless told
# not to; the slot and block counts follow each layer's placement (an EPLB move changes some),
# and specialising on them compiled new variants inside decode steps after a move (0.1-0.3 s each)


@dataclass(frozen=True)
class Alignment:
    sorted_pairs: torch.Tensor  # [R] int32: pair index t*K+k of each row (padding rows unset)
    block_slot: torch.Tensor  # [B] int32: slot of each block, -1 past the end
    slot_start: torch.Tensor  # [S] int32: first row of each slot (a multiple of block_m)
    slot_count: torch.Tensor  # [S] int32: pairs routed to each slot
    block_m: int

    @property
    def max_blocks(self) -> int:
        return self.block_slot.shape[0]


def max_rows(num_pairs: int, num_slots: int, block_m: int) -> int:
    """Upper bound on padded rows: every non-empty slot wastes at most block_m - 1 rows."""
    return triton.cdiv(num_pairs + min(num_slots, num_pairs) * (block_m - 1), block_m) * block_m


@triton.jit(do_not_specialize=["num_pairs", "num_slots"])
def _count_kernel(slot_ptr, count_ptr, num_pairs, num_slots, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    s = tl.load(slot_ptr + offs, mask=offs < num_pairs, other=-1)
    ok = (s >= 0) & (s < num_slots)  # NOTE: ids >= S are a caller error; never write out of bounds
    tl.atomic_add(count_ptr + s, 1, mask=ok)


@triton.jit(do_not_specialize=["num_slots", "num_blocks"])
def _map_kernel(
    count_ptr,
    start_ptr,
    block_slot_ptr,
    num_slots,
    num_blocks,
    BLOCK_M: tl.constexpr,
    S_PAD: tl.constexpr,
    CHUNK: tl.constexpr,
):
    # every program redoes the (cheap) scan over S so the map needs no second launch
    s = tl.arange(0, S_PAD)
    cnt = tl.load(count_ptr + s, mask=s < num_slots, other=0)
    padded = (cnt + BLOCK_M - 1) // BLOCK_M * BLOCK_M  # [S_PAD]
    ends = tl.cumsum(padded, 0)  # [S_PAD]
    pid = tl.program_id(0)
    if pid == 0:
        tl.store(start_ptr + s, ends - padded, mask=s < num_slots)
    b = pid * CHUNK + tl.arange(0, CHUNK)  # [CHUNK]
    # the slot of block b is the number of slots that end at or before its first row
    done = (ends[None, :] <= (b * BLOCK_M)[:, None]).to(tl.int32)  # [CHUNK, S_PAD]
    slot = tl.sum(done, axis=1)
    slot = tl.where(slot < num_slots, slot, -1)
    tl.store(block_slot_ptr + b, slot, mask=b < num_blocks)


@triton.jit(do_not_specialize=["num_pairs", "num_slots"])
def _scatter_kernel(slot_ptr, start_ptr, cursor_ptr, sorted_ptr, num_pairs, num_slots, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    s = tl.load(slot_ptr + offs, mask=offs < num_pairs, other=-1)
    ok = (s >= 0) & (s < num_slots)
    rank = tl.atomic_add(cursor_ptr + s, 1, mask=ok)
    start = tl.load(start_ptr + s, mask=ok, other=0)
    tl.store(sorted_ptr + start + rank, offs, mask=ok)


@triton.jit(do_not_specialize=["num_pairs", "num_slots", "num_blocks"])
def _align_one_program_kernel(
    slot_ptr,
    count_ptr,
    cursor_ptr,
    start_ptr,
    block_slot_ptr,
    sorted_ptr,
    num_pairs,
    num_slots,
    num_blocks,
    BLOCK_M: tl.constexpr,
    P_PAD: tl.constexpr,
    S_PAD: tl.constexpr,
    B_PAD: tl.constexpr,
):
    """count, map and scatter in one program (decode sizes): one launch instead of three plus
    a memset. Barriers order the phases; the counters are read back through L2 (volatile)."""
    s_idx = tl.arange(0, S_PAD)
    s_ok = s_idx < num_slots
    tl.store(count_ptr + s_idx, tl.zeros([S_PAD], tl.int32), mask=s_ok)
    tl.store(cursor_ptr + s_idx, tl.zeros([S_PAD], tl.int32), mask=s_ok)
    tl.debug_barrier()
    offs = tl.arange(0, P_PAD)
    s = tl.load(slot_ptr + offs, mask=offs < num_pairs, other=-1)
    ok = (s >= 0) & (s < num_slots)
    tl.atomic_add(count_ptr + s, 1, mask=ok)
    tl.debug_barrier()
    cnt = tl.load(count_ptr + s_idx, mask=s_ok, other=0, volatile=True)
    padded = (cnt + BLOCK_M - 1) // BLOCK_M * BLOCK_M  # [S_PAD]
    ends = tl.cumsum(padded, 0)
    tl.store(start_ptr + s_idx, ends - padded, mask=s_ok)
    b = tl.arange(0, B_PAD)
    slot = tl.sum((ends[None, :] <= (b * BLOCK_M)[:, None]).to(tl.int32), axis=1)  # [B_PAD]
    tl.store(block_slot_ptr + b, tl.where(slot < num_slots, slot, -1), mask=b < num_blocks)
    tl.debug_barrier()
    start = tl.load(start_ptr + s, mask=ok, other=0, volatile=True)
    rank = tl.atomic_add(cursor_ptr + s, 1, mask=ok)
    tl.store(sorted_ptr + start + rank, offs, mask=ok)


# the one-program path holds a [blocks, slots] comparison in registers: keep it small
_ONE_PROGRAM_MAX = 16384


def align_pairs(
    slot_ids: torch.Tensor, num_slots: int, block_m: int, one_program: bool | None = None
) -> Alignment:
    """Sort the pairs of ``slot_ids [T, K]`` (int32, contiguous, -1 = skip) by slot into blocks.

    ``one_program``: all in one launch (default: when the pairs and blocks are few, as in decode)."""
    assert slot_ids.dtype == torch.int32 and slot_ids.is_contiguous(), f"{slot_ids.dtype=}"
    num_pairs = slot_ids.numel()
    dev = slot_ids.device
    rows = max_rows(num_pairs, num_slots, block_m)
    num_blocks = rows // block_m
    s_pad = max(16, triton.next_power_of_2(num_slots))
    b_pad = max(16, triton.next_power_of_2(num_blocks))
    p_pad = max(16, triton.next_power_of_2(num_pairs))
    if one_program is None:
        one_program = b_pad * s_pad <= _ONE_PROGRAM_MAX and p_pad <= 1024
    # counts, then cursors from a 16-byte boundary: Triton specialises on a pointer's alignment,
    # and a cursor right after S counts would compile a variant per S mod 4
    off = -(-num_slots // 4) * 4
    counters = (torch.empty if one_program else torch.zeros)(off + num_slots, dtype=torch.int32, device=dev)
    count, cursor = counters[:num_slots], counters[off:]
    start = torch.empty(num_slots, dtype=torch.int32, device=dev)
    block_slot = torch.empty(num_blocks, dtype=torch.int32, device=dev)
    sorted_pairs = torch.empty(rows, dtype=torch.int32, device=dev)
    if one_program:
        _align_one_program_kernel[(1,)](
            slot_ids, count, cursor, start, block_slot, sorted_pairs, num_pairs, num_slots, num_blocks,
            BLOCK_M=block_m, P_PAD=p_pad, S_PAD=s_pad, B_PAD=b_pad, num_warps=4,
        )  # fmt: skip
        return Alignment(sorted_pairs, block_slot, start, count, block_m)
    pair_grid = (triton.cdiv(num_pairs, _PAIR_BLOCK),)
    _count_kernel[pair_grid](slot_ids, count, num_pairs, num_slots, BLOCK=_PAIR_BLOCK)
    chunk = max(16, min(_MAP_BLOCKS, 8192 // s_pad))
    _map_kernel[(triton.cdiv(num_blocks, chunk),)](
        count, start, block_slot, num_slots, num_blocks, BLOCK_M=block_m, S_PAD=s_pad, CHUNK=chunk
    )
    _scatter_kernel[pair_grid](slot_ids, start, cursor, sorted_pairs, num_pairs, num_slots, BLOCK=_PAIR_BLOCK)
    return Alignment(sorted_pairs, block_slot, start, count, block_m)
