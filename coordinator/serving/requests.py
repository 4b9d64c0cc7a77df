"""Validation of ``GenerateRequest`` messages: every bad field becomes an :class:`InvalidRequest`
with a message the client sees as INVALID_ARGUMENT; a valid one becomes the scheduler's
prompt ids and :class:`~coordinator.serving.sampler.SamplingParams`.

Every field a client controls is bounded before any work proportional to it is done
(:class:`InputLimits`): prompt bytes before tokenizing, id counts before checking each id, stop
strings by count and length, the echoed request id by length. Tokenizing a long prompt releases
the GIL and runs off the event loop (:func:`parse_request_async`), so one big prompt never
stalls health checks or other streams. A message that protobuf cannot parse (a string field that
is not UTF-8) is rejected as INVALID_ARGUMENT naming the field (:func:`add_generation_servicer`).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError, Message

from coordinator.config import InputLimits
from coordinator.serving.sampler import SamplingParams
from coordinator.serving.tokenizer import PromptTooLong, TextTokenizer
from expertmesh.v1 import generation_pb2

# prompts up to this many UTF-8 bytes are tokenized on the event loop: a thread hop would cost
# more than the tokenization (well under a millisecond)
INLINE_PROMPT_BYTES = 1024
_QUOTE_CHARS = 40  # of a client's string quoted back in an error message


class InvalidRequest(ValueError):
    pass


@dataclass(frozen=True)
class RequestLimits:
    vocab_size: int
    max_context: int
    default_max_new_tokens: int
    input: InputLimits = field(default_factory=InputLimits)


def parse_request(
    req: generation_pb2.GenerateRequest,
    limits: RequestLimits,
    tokenizer: TextTokenizer | None,
    adapters: Collection[str] = (),
) -> tuple[list[int], SamplingParams]:
    """Checks a request and turns it into (prompt ids, sampling params); InvalidRequest says why.
    Tokenizes on the calling thread (see :func:`parse_request_async`)."""
    check_bounds(req, limits, tokenizer)
    ids = _tokenize(tokenizer, req.prompt, limits) if req.prompt and tokenizer else None
    return finish_parse(req, limits, ids, adapters)


async def parse_request_async(
    req: generation_pb2.GenerateRequest | InvalidRequest,
    limits: RequestLimits,
    tokenizer: TextTokenizer | None,
    adapters: Collection[str] = (),
) -> tuple[list[int], SamplingParams]:
    """:func:`parse_request` for the event loop: a prompt longer than ``INLINE_PROMPT_BYTES`` is
    tokenized in a worker thread (the tokenizer releases the GIL), after the byte limit passed.
    ``req`` may be the :class:`InvalidRequest` that :func:`decode_generate_request` returned."""
    if isinstance(req, InvalidRequest):
        raise req
    n_bytes = check_bounds(req, limits, tokenizer)
    ids = None
    if req.prompt and tokenizer is not None:
        if n_bytes <= INLINE_PROMPT_BYTES:
            ids = _tokenize(tokenizer, req.prompt, limits)
        else:
            ids = await asyncio.to_thread(_tokenize, tokenizer, req.prompt, limits)
    return finish_parse(req, limits, ids, adapters)


def _tokenize(tokenizer: TextTokenizer, prompt: str, limits: RequestLimits) -> list[int]:
    try:
        return tokenizer.encode(prompt, max_tokens=limits.max_context - 1)
    except PromptTooLong as e:
        raise InvalidRequest(_too_long(e.tokens, limits)) from None


def _too_long(n: int, limits: RequestLimits) -> str:
    return f"prompt of {n} tokens does not fit the max context of {limits.max_context} tokens"


def check_bounds(
    req: generation_pb2.GenerateRequest, limits: RequestLimits, tokenizer: TextTokenizer | None
) -> int:
    """The checks that cost O(limits), not O(request): run before any per-token work.
    Returns the prompt's size in UTF-8 bytes."""
    lim = limits.input
    if req.prompt and req.input_ids:
        raise InvalidRequest("give either prompt or input_ids, not both")
    n_bytes = 0
    if req.prompt:
        if tokenizer is None:
            raise InvalidRequest("this model has no tokenizer.json: send input_ids instead of prompt text")
        n_bytes = check_prompt_bytes(req.prompt, lim)
    if req.stop and tokenizer is None:
        raise InvalidRequest("stop strings need a tokenizer: this model has no tokenizer.json")
    if len(req.input_ids) >= limits.max_context:  # NOTE: before any per-id work
        raise InvalidRequest(_too_long(len(req.input_ids), limits))
    if len(req.stop) > lim.max_stop_strings:
        raise InvalidRequest(
            f"{len(req.stop)} stop strings exceed the limit of {lim.max_stop_strings} (--max-stop-strings)"
        )
    for s in req.stop:
        if _utf8_size(s, lim.max_stop_bytes) > lim.max_stop_bytes:
            raise InvalidRequest(
                f"stop string {_quote(s)} is longer than the limit of {lim.max_stop_bytes} bytes "
                "(--max-stop-bytes)"
            )
    if len(req.stop_token_ids) > lim.max_stop_token_ids:
        raise InvalidRequest(
            f"{len(req.stop_token_ids)} stop_token_ids exceed the limit of {lim.max_stop_token_ids} "
            "(--max-stop-token-ids)"
        )
    rid = req.request_id
    if _utf8_size(rid, lim.max_request_id_bytes) > lim.max_request_id_bytes:
        raise InvalidRequest(
            f"request_id {_quote(rid)} is longer than the limit of {lim.max_request_id_bytes} bytes "
            "(--max-request-id-bytes)"
        )
    return n_bytes


def check_prompt_bytes(prompt: str, lim: InputLimits) -> int:
    """The prompt's UTF-8 size, or InvalidRequest beyond ``--max-prompt-bytes``."""
    n_bytes = _utf8_size(prompt, lim.max_prompt_bytes)
    if n_bytes > lim.max_prompt_bytes:
        raise InvalidRequest(
            f"prompt of {len(prompt)} characters is longer than the limit of "
            f"{lim.max_prompt_bytes} bytes (--max-prompt-bytes)"
        )
    return n_bytes


def _utf8_size(s: str, limit: int) -> int:
    """Bytes of ``s`` in UTF-8; only a lower bound, ``len(s)``, when that already exceeds
    ``limit`` (a character is at least one byte): a huge string is never encoded.
    InvalidRequest for a lone surrogate (JSON's ``"\\ud800"`` decodes to one; protobuf refuses it)."""
    if len(s) > limit:
        return len(s)
    try:
        return len(s.encode("utf-8"))
    except UnicodeEncodeError as e:
        raise InvalidRequest(
            f"text {_quote(s)} is not valid Unicode: lone surrogate {s[e.start]!r} at character {e.start}"
        ) from None


def _quote(s: str) -> str:
    """A client's string for an error message: clipped, so that the status stays small."""
    return repr(s) if len(s) <= _QUOTE_CHARS else f"{s[:_QUOTE_CHARS]!r}... ({len(s)} characters)"


def finish_parse(
    req: generation_pb2.GenerateRequest,
    limits: RequestLimits,
    prompt_ids: list[int] | None,
    adapters: Collection[str] = (),
) -> tuple[list[int], SamplingParams]:
    """The rest of the checks, once :func:`check_bounds` passed and the prompt (if text) is
    tokenized to ``prompt_ids``."""
    ids = list(req.input_ids) if prompt_ids is None else prompt_ids
    if not ids:
        raise InvalidRequest("empty input: give a non-empty prompt or input_ids")
    _check_ids("prompt tokens" if req.prompt else "input_ids", ids, limits.vocab_size)
    if len(ids) >= limits.max_context:
        raise InvalidRequest(_too_long(len(ids), limits))
    room = limits.max_context - len(ids)
    if req.HasField("max_new_tokens"):
        n = req.max_new_tokens
        if n < 0 or (n == 0 and not req.prompt_logprobs):
            raise InvalidRequest(f"max_new_tokens must be positive (0 only with prompt_logprobs), got {n}")
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
    if any(not s for s in req.stop):
        raise InvalidRequest("empty stop string")
    _check_ids("stop_token_ids", req.stop_token_ids, limits.vocab_size)
    if req.lora and req.lora not in adapters:
        loaded = ", ".join(sorted(adapters)) or "none"
        raise InvalidRequest(f"unknown adapter {_quote(req.lora)} (loaded: {loaded})")
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
        prompt_logprobs=req.prompt_logprobs,
    )
    return ids, params


def _check_ids(what: str, ids: Sequence[int], vocab: int) -> None:
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise InvalidRequest(f"{what} outside the vocabulary [0, {vocab}): {bad[:8]}")


# ---------------------------------------------------------------------- servicers


def _bytes_twin(message: type[Message]) -> type[Message]:
    """A message class with ``message``'s fields, its ``string`` fields turned into ``bytes``:
    it parses what ``message`` refuses for invalid UTF-8, so the error can name the field."""
    proto = descriptor_pb2.FileDescriptorProto(
        name=f"twin/{message.DESCRIPTOR.full_name}.proto", package="twin", syntax="proto3"
    )
    message.DESCRIPTOR.CopyToProto(proto.message_type.add())
    for f in proto.message_type[0].field:
        if f.type == f.TYPE_STRING:
            f.type = f.TYPE_BYTES
        if f.type in (f.TYPE_MESSAGE, f.TYPE_ENUM):  # GenerateRequest has none; keep the twin flat
            raise TypeError(f"{message.DESCRIPTOR.full_name}.{f.name}: nested types are not supported")
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(f"twin.{message.DESCRIPTOR.name}"))


_RAW_GENERATE_REQUEST = _bytes_twin(generation_pb2.GenerateRequest)


def decode_generate_request(data: bytes) -> generation_pb2.GenerateRequest | InvalidRequest:
    """The Generate request deserializer: a message protobuf refuses becomes the InvalidRequest
    that :func:`parse_request_async` raises (INVALID_ARGUMENT), instead of gRPC's UNKNOWN or
    INTERNAL for a deserializer error."""
    try:
        return generation_pb2.GenerateRequest.FromString(data)
    except DecodeError:
        pass
    try:
        raw = _RAW_GENERATE_REQUEST.FromString(data)
    except DecodeError as e:
        return InvalidRequest(f"malformed GenerateRequest: not a valid protobuf message ({type(e).__name__})")
    for f in raw.DESCRIPTOR.fields:
        if generation_pb2.GenerateRequest.DESCRIPTOR.fields_by_name[f.name].type != f.TYPE_STRING:
            continue
        values = getattr(raw, f.name)
        for i, v in enumerate(values if f.is_repeated else [values]):
            try:
                v.decode("utf-8")
            except UnicodeDecodeError as e:
                where = f"{f.name}[{i}]" if f.is_repeated else f.name
                return InvalidRequest(f"{where} is not valid UTF-8 ({e.reason} at byte {e.start})")
    return InvalidRequest("malformed GenerateRequest")


def add_generation_servicer(servicer, server: grpc.aio.Server) -> None:
    """``generation_pb2_grpc.add_GenerationServicer_to_server`` with
    :func:`decode_generate_request` as the request deserializer."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate,
            request_deserializer=decode_generate_request,
            response_serializer=generation_pb2.GenerateResponse.SerializeToString,
        )
    }
    service = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
    server.add_registered_method_handlers(service, handlers)
