"""What one forward step computes: a flat list of tokens from several sequences.

Shapes: T tokens in the step, B sequences.
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
    kv_index: torch.Tensor  # [past + length] flat cache rows of positions 0..past+length-1


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    write_index: torch.Tensor  # [T] flat cache row each new token's K/V goes to
    chunks: tuple[SeqChunk, ...]  # B
    logits_index: torch.Tensor  # [B'] rows of T whose logits are wanted

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
        ``all_logits``.
        """
        ids: list[int] = []
        pos: list[int] = []
        chunks: list[SeqChunk] = []
        logit_rows: list[int] = []
        write: list[torch.Tensor] = []
        for new, past, pages in seqs:
            n = len(new)
            assert n > 0, "a sequence in the step has no new tokens"
            total = past + n
            assert len(pages) * page_size >= total, f"{len(pages)=} {page_size=} {total=}"
            p = torch.arange(total)
            table = torch.tensor(pages, dtype=torch.long)
            rows = table[p // page_size] * page_size + p % page_size  # [past + n]
            chunks.append(SeqChunk(len(ids), n, past, rows.to(device)))
            write.append(rows[past:])
            start = len(ids)
            ids.extend(new)
            pos.extend(range(past, total))
            logit_rows.extend(range(start, start + n) if all_logits else [start + n - 1])
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=device),
            positions=torch.tensor(pos, dtype=torch.long, device=device),
            write_index=torch.cat(write).to(device),
            chunks=tuple(chunks),
            logits_index=torch.tensor(logit_rows, dtype=torch.long, device=device),
        )
