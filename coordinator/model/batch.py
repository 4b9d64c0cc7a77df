"""What one forward step computes: a flat list of tokens from several sequences.

Shapes: T tokens in the step, B sequences, W page-table width (pages of the longest sequence).
"""

from __future__ import annotations

from dataclasses import dataclass

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
class ForwardBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T] int64
    write_index: torch.Tensor  # [T] flat cache row each new token's K/V goes to
    chunks: tuple[SeqChunk, ...]  # B
    logits_index: torch.Tensor  # [B'] rows of T whose logits are wanted
    page_table: torch.Tensor  # [B, W] int32 page ids of each sequence (0-padded)
    token_seq: torch.Tensor  # [T] int32 sequence (page-table row) of each token
    page_size: int

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
        chunks: list[SeqChunk] = []
        logit_rows: list[int] = []
        write: list[int] = []
        on_cpu = device.type == "cpu"
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
            kv_index = None
            if on_cpu:
                p = torch.arange(total)
                rows = (
                    torch.tensor(pages[:need], dtype=torch.long)[p // page_size] * page_size + p % page_size
                )
                kv_index = rows  # [past + n]
            chunks.append(SeqChunk(len(ids), n, past, kv_index))
            write.extend(pages[q // page_size] * page_size + q % page_size for q in range(past, total))
            start = len(ids)
            ids.extend(new)
            pos.extend(range(past, total))
            tok_seq.extend([b] * n)
            logit_rows.extend(range(start, start + n) if all_logits else [start + n - 1])
        t, b_rows = len(ids), len(logit_rows)
        # one copy: [ids | pos | write | tok_seq | logit_rows | table]
        flat = torch.tensor(ids + pos + write + tok_seq + logit_rows + table, dtype=torch.long)
        flat = flat.to(device)
        ids_d, pos_d, write_d, seq_d, logit_d, table_d = flat.split([t, t, t, t, b_rows, len(table)])
        return ForwardBatch(
            input_ids=ids_d,
            positions=pos_d,
            write_index=write_d,
            chunks=tuple(chunks),
            logits_index=logit_d,
            page_table=table_d.view(len(seqs), width).to(torch.int32),
            token_seq=seq_d.to(torch.int32),
            page_size=page_size,
        )
