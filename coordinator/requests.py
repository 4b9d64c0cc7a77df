"""Validation of ``GenerateRequest`` messages: every bad field becomes an :class:`InvalidRequest`
with a message the client sees as INVALID_ARGUMENT; a valid one becomes the scheduler's
prompt ids and :class:`~coordinator.sampler.SamplingParams`."""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from coordinator.sampler import SamplingParams
from coordinator.tokenizer import TextTokenizer
from expertmesh.v1 import generation_pb2


class InvalidRequest(ValueError):
    pass


@dataclass(frozen=True)
class RequestLimits:
    vocab_size: int
    max_context: int
    default_max_new_tokens: int


def parse_request(
    req: generation_pb2.GenerateRequest,
    limits: RequestLimits,
    tokenizer: TextTokenizer | None,
    adapters: Collection[str] = (),
) -> tuple[list[int], SamplingParams]:
    """Checks a request and turns it into (prompt ids, sampling params); InvalidRequest says why."""
    if req.prompt and req.input_ids:
        raise InvalidRequest("give either prompt or input_ids, not both")
    if req.prompt:
        if tokenizer is None:
            raise InvalidRequest("this model has no tokenizer.json: send input_ids instead of prompt text")
        ids = tokenizer.encode(req.prompt)
    else:
        ids = list(req.input_ids)
    if not ids:
        raise InvalidRequest("empty input: give a non-empty prompt or input_ids")
    _check_ids("prompt tokens" if req.prompt else "input_ids", ids, limits.vocab_size)
    if len(ids) >= limits.max_context:
        raise InvalidRequest(
            f"prompt of {len(ids)} tokens does not fit the max context of {limits.max_context} tokens"
        )
    room = limits.max_context - len(ids)
    if req.HasField("max_new_tokens"):
        n = req.max_new_tokens
        if n <= 0:
            raise InvalidRequest(f"max_new_tokens must be positive, got {n}")
        if n > room:
            raise InvalidRequest(
                f"max_new_tokens {n} with a prompt of {len(ids)} tokens exceeds the max context of "
                f"{limits.max_context} tokens (at most {room} new tokens)"
            )
    else:
        n = min(limits.default_max_new_tokens, room)
    temperature = req.temperature if req.HasField("temperature") else 0.0
    if not (math.isfinite(temperature) and temperature >= 0):
        raise InvalidRequest(f"temperature must be >= 0, got {temperature}")
    top_p = req.top_p if req.HasField("top_p") else 1.0
    if not 0 < top_p <= 1:  # NaN fails too
        raise InvalidRequest(f"top_p must be in (0, 1], got {top_p}")
    top_k = req.top_k if req.HasField("top_k") else 0
    if top_k < 0:
        raise InvalidRequest(f"top_k must be >= 0 (0 = no limit), got {top_k}")
    if req.stop and tokenizer is None:
        raise InvalidRequest("stop strings need a tokenizer: this model has no tokenizer.json")
    if any(not s for s in req.stop):
        raise InvalidRequest("empty stop string")
    _check_ids("stop_token_ids", req.stop_token_ids, limits.vocab_size)
    if req.lora and req.lora not in adapters:
        loaded = ", ".join(sorted(adapters)) or "none"
        raise InvalidRequest(f"unknown adapter {req.lora!r} (loaded: {loaded})")
    params = SamplingParams(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=req.seed if req.HasField("seed") else None,
        max_new_tokens=n,
        stop=tuple(req.stop),
        stop_token_ids=tuple(req.stop_token_ids),
        ignore_eos=req.ignore_eos,
        logprobs=req.logprobs,
    )
    return ids, params


def _check_ids(what: str, ids: Sequence[int], vocab: int) -> None:
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise InvalidRequest(f"{what} outside the vocabulary [0, {vocab}): {bad[:8]}")


# ---------------------------------------------------------------------- servicers
