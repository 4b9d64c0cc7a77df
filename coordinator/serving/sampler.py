"""Token sampling: greedy, temperature, top-k, top-p, with one random generator per request.

Every row of a step's logits is sampled with its own request's ``torch.Generator``, so a seeded
request draws the same tokens whatever else shares its batch (up to the float rounding of the
logits themselves, which batching does not change in float32 on the CPU).

The returned log-probability of a chosen token is ``log_softmax`` of the *raw* logits in float32,
before temperature, top-k or top-p: it is the model's own probability of that token, comparable
across sampling settings (and equal to a reference model's log-softmax at that position).

Shapes: B rows (requests) in the step, V vocab.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # (0, 1]
    top_k: int = 0  # 0 = no limit
    seed: int | None = None  # None = a fresh random seed per request
    max_new_tokens: int = 64
    stop: tuple[str, ...] = ()  # stop strings, cut from the text
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0  # also return this many most likely tokens per step (HTTP API)
    # also each prompt token's logprob given the tokens before it (and its top_logprobs), from
    # the prefill; with max_new_tokens 0 the request ends there (scoring a text, not extending it)
    prompt_logprobs: bool = False

    def __post_init__(self) -> None:
        assert math.isfinite(self.temperature) and self.temperature >= 0, f"{self.temperature=}"
        assert 0 < self.top_p <= 1, f"{self.top_p=}"
        assert self.top_k >= 0, f"{self.top_k=}"
        assert self.max_new_tokens > 0 or (self.prompt_logprobs and self.max_new_tokens == 0), f"{self}"
        assert all(self.stop), f"empty stop string in {self.stop=}"
        assert self.top_logprobs >= 0, f"{self.top_logprobs=}"

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """The request's own generator (None for greedy requests, which draw nothing)."""
    if params.greedy:
        return None
    seed = params.seed if params.seed is not None else secrets.randbits(63)
    return torch.Generator(device=device).manual_seed(seed)


def _filtered_probs(
    logits: torch.Tensor,  # [B, V] float32
    temperature: torch.Tensor,  # [B]
    top_k: torch.Tensor,  # [B] long, 0 = no limit
    top_p: torch.Tensor,  # [B]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Probabilities after temperature, top-k and top-p, in descending-logit order.

    Returns ``(probs [B, V], order [B, V])``: ``probs[:, j]`` belongs to token ``order[:, j]``.
    """
    sorted_logits, order = torch.sort(logits / temperature[:, None], dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1], device=logits.device)[None, :]  # [1, V]
    limit = torch.where(top_k > 0, top_k, logits.shape[-1])[:, None]  # [B, 1]
    sorted_logits = sorted_logits.masked_fill(rank >= limit, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    # top-p: keep the smallest prefix whose mass reaches top_p (the first token always stays)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    probs = probs.masked_fill(mass_before >= top_p[:, None], 0.0)
    return probs / probs.sum(dim=-1, keepdim=True), order


def sample(
    logits: torch.Tensor,  # [B, V]
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Picks one token per row.

    Returns ``(tokens [B] long, logprobs [B] float32)``; see the module docstring for what the
    log-probability is.
    """
    assert logits.dim() == 2 and logits.shape[0] == len(params) == len(generators), (
        f"{tuple(logits.shape)=} {len(params)=} {len(generators)=}"
    )
    logits = logits.float()
    tokens = logits.argmax(dim=-1)  # [B] greedy rows are final here
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        dev = logits.device
        sub = [params[i] for i in rows]
        every = len(rows) == len(params)
        index = None if every else _to(dev, rows, torch.long)
        probs, order = _filtered_probs(
            logits if index is None else logits[index],
            _to(dev, [p.temperature for p in sub], torch.float32),
            _to(dev, [p.top_k for p in sub], torch.long),
            _to(dev, [p.top_p for p in sub], torch.float32),
        )
        # exponential race: argmax(p / E) with E ~ Exp(1) draws index j with probability p_j,
        # each row from its own generator
        race = torch.stack([torch.empty_like(probs[0]).exponential_(generator=generators[i]) for i in rows])
        race.clamp_min_(torch.finfo(race.dtype).tiny)  # an exact 0 draw would make 0/0
        picked = torch.argmax(probs / race, dim=-1, keepdim=True)  # [B_s, 1] positions in `order`
        chosen = order.gather(1, picked).squeeze(1)
        if index is None:
            tokens = chosen
        else:
            tokens.index_copy_(0, index, chosen)
    logprobs = torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None]).squeeze(1)
    return tokens, logprobs


def _to(device: torch.device, values: list, dtype: torch.dtype) -> torch.Tensor:
    """A small host list on ``device`` without waiting for its stream (pinned, non-blocking):
    the scheduler samples a step while the next one is queued behind it."""
    t = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
