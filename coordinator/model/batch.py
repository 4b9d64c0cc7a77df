"""What one forward step computes: a flat list of tokens from several sequences.

Shapes: T tokens in the step, B sequences, W page-table width (pages of the longest sequence),
B_d sequences of the step that decode (one new token), W_d pages of the longest of them, P page
size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SeqChunk:
    """A contiguous run of a sequence's new tokens inside the step."""

    start: int  # offset in the step's T tokens
    length: int  # new tokens of this sequence in the step
    past: int  # tokens of this sequence already in the KV cache
    # [past + length] flat cache rows of positions 0..past+length-1; built on the CPU only (the
    # plain-torch attention reads it), the GPU kernels walk the page table instead
    kv_index: torch.Tensor | None


@dataclass(frozen=True)
class DecodeRows:
    """The step's one-token chunks as the CPU attention reads them, built once per step (every
    layer would otherwise rebuild the same index and mask): their sequences' pages, 0-padded to
    the longest, and an additive mask of the padding."""

    seqs: tuple[int, ...]  # B_d chunk numbers
    rows: torch.Tensor  # [B_d] long, their rows of T
    pages: torch.Tensor  # [B_d * W_d] long page ids (pad: page 0, masked)
    mask: torch.Tensor  # [B_d, 1, W_d * P] float32: 0 for keys 0..past, -inf past the end
    # the mask laid out per (KV heads, dtype) the attention asks for, made by its first layer
    head_masks: dict[tuple[int, torch.dtype], torch.Tensor] = field(default_factory=dict, compare=False)

    @property
    def width(self) -> int:  # W_d * P keys per sequence
        return int(self.mask.shape[-1])


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T] int64
    write_index: torch.Tensor  # [T] flat cache row each new token's K/V goes to
    chunks: tuple[SeqChunk, ...]  # B
    logits_index: torch.Tensor  # [B'] rows of T whose logits are wanted
    page_table: torch.Tensor  # [B, W] int32 page ids of each sequence (0-padded)
    token_seq: torch.Tensor  # [T] int32 sequence (page-table row) of each token
    page_size: int
    decode: DecodeRows | None = None  # CPU steps with one-token chunks only
    # values every layer derives alike from the step (rotary cos/sin by dtype), made by the
    # first layer that needs them (CPU steps only: a CUDA graph captures its own)
    memo: dict[object, object] = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @staticmethod
    def build(
        seqs: list[tuple[list[int], int, list[int]]],
        page_size: int,
        device: torch.device,
        all_logits: bool = False,
    ) -> ForwardBatch:
        """seqs: (new token ids, tokens already cached, page table) per sequence.

        Logits are kept for the last new token of each sequence, or for every token when
        ``all_logits``. The step's metadata reaches the device in one host-to-device copy.
        """
        ids: list[int] = []
        pos: list[int] = []
        tok_seq: list[int] = []
        starts: list[int] = []
        logit_rows: list[int] = []
        write: list[int] = []
        width = max(1, max(-(-(past + len(new)) // page_size) for new, past, _ in seqs))
        table: list[int] = []
        for b, (new, past, pages) in enumerate(seqs):
            n = len(new)
            assert n > 0, "a sequence in the step has no new tokens"
            total = past + n
            need = -(-total // page_size)
            assert len(pages) >= need, f"{len(pages)=} {page_size=} {total=}"
            table.extend(pages[:need])
            table.extend([0] * (width - need))
            write.extend(pages[q // page_size] * page_size + q % page_size for q in range(past, total))
            start = len(ids)
            starts.append(start)
            ids.extend(new)
            pos.extend(range(past, total))
            tok_seq.extend([b] * n)
            logit_rows.extend(range(start, start + n) if all_logits else [start + n - 1])
        on_cpu = device.type == "cpu"
        dec = [b for b, (new, _, _) in enumerate(seqs) if len(new) == 1] if on_cpu else []
        dec_width = max((-(-(seqs[b][1] + 1) // page_size) for b in dec), default=0)
        dec_pages = [p for b in dec for p in table[b * width : b * width + dec_width]]
        t, b_rows = len(ids), len(logit_rows)
        # one copy: [ids | pos | write | tok_seq | logit_rows | table | decode rows | decode pages]
        flat = torch.tensor(
            ids + pos + write + tok_seq + logit_rows + table + [starts[b] for b in dec] + dec_pages,
            dtype=torch.long,
        )
        flat = flat.to(device)
        parts = [t, t, t, t, b_rows, len(table), len(dec), len(dec_pages)]
        ids_d, pos_d, write_d, seq_d, logit_d, table_d, dec_rows, dec_pages_d = flat.split(parts)
        table_d = table_d.view(len(seqs), width)
        chunks = _chunks(seqs, starts, table_d, page_size, on_cpu)
        decode = None
        if dec:
            keys = torch.arange(dec_width * page_size)  # [W_d * P]
            length = torch.tensor([seqs[b][1] + 1 for b in dec])  # [B_d]
            pad = keys[None, :] >= length[:, None]  # [B_d, W_d * P]
            mask = torch.zeros(pad.shape).masked_fill_(pad, float("-inf"))[:, None, :]
            decode = DecodeRows(tuple(dec), dec_rows, dec_pages_d, mask)
        return ForwardBatch(
            input_ids=ids_d,
            positions=pos_d,
            write_index=write_d,
            chunks=chunks,
            logits_index=logit_d,
            page_table=table_d.to(torch.int32),
            token_seq=seq_d.to(torch.int32),
            page_size=page_size,
            decode=decode,
        )


def _chunks(
    seqs: list[tuple[list[int], int, list[int]]],
    starts: list[int],
    table: torch.Tensor,  # [B, W] long
    page_size: int,
    on_cpu: bool,
) -> tuple[SeqChunk, ...]:
    """Each sequence's chunk; on the CPU with its cache rows, sliced from one [B, W * P] table of
    rows (one set of ops for the step, not one per sequence)."""
    if not on_cpu:
        return tuple(SeqChunk(s, len(new), past, None) for s, (new, past, _) in zip(starts, seqs))
    rows = (table[:, :, None] * page_size + torch.arange(page_size)).view(len(seqs), -1)  # [B, W * P]
    return tuple(
        SeqChunk(s, len(new), past, rows[b, : past + len(new)])
        for b, (s, (new, past, _)) in enumerate(zip(starts, seqs))
    )
