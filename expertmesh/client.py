"""Python client of the coordinator's Generation API, sync and asyncio.

    from expertmesh.client import Client
    with Client("127.0.0.1:50051") as c:
        out = c.generate(prompt="Once upon a time", max_new_tokens=32)
        print(out.text, out.finish_reason)
        for chunk in c.stream(input_ids=[0, 5, 9], max_new_tokens=8):
            print(chunk.token_ids, chunk.text)

``AsyncClient`` has the same methods as coroutines / async iterators. A failed request raises
the library's typed error of its status (:mod:`expertmesh.errors`: ``InvalidRequest`` for a
bad request, ``Unavailable`` while the expert servers are not ready, ``DeadlineExceeded``, ...;
other statuses, e.g. RESOURCE_EXHAUSTED when the coordinator is overloaded, as the base
``ExpertMeshError``). Each is also a ``grpc.RpcError`` with ``code()`` and ``details()``.
Leaving a stream early cancels the request on the server, which frees its KV cache pages.

Token ids of a completion include the token that ended it (EOS, a stop token, or the token that
completed a stop string); its text leaves out special tokens and the stop string.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import grpc

from expertmesh import errors
from expertmesh import tls as _tls
from expertmesh.status import from_rpc_error
from expertmesh.tls import TLSConfig
from expertmesh.v1 import generation_pb2, generation_pb2_grpc


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # of prompt_tokens, served from the coordinator's prefix cache


@dataclass(frozen=True)
class Chunk:
    """One streamed piece; the last one has ``finish_reason`` and ``usage``."""

    token_ids: list[int]
    text: str
    logprobs: list[float]
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error"
    usage: Usage | None = None
    request_id: str = ""
    prompt_logprobs: list[float] | None = None  # the first chunk's, when asked (prompt_logprobs=True)


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]
    text: str
    finish_reason: str
    usage: Usage
    logprobs: list[float] | None = None  # one per token id, when asked
    request_id: str = ""
    chunks: int = field(default=0, compare=False)  # how many streamed pieces it came in
    # when asked: each prompt token's log-probability given the tokens before it, from the
    # second prompt token on (the first has no context)
    prompt_logprobs: list[float] | None = None


def build_request(
    prompt: str | None = None,
    input_ids: Sequence[int] | None = None,
    *,
    max_new_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    stop: Iterable[str] = (),
    stop_token_ids: Iterable[int] = (),
    ignore_eos: bool = False,
    logprobs: bool = False,
    lora: str = "",
    request_id: str = "",
    prompt_logprobs: bool = False,
) -> generation_pb2.GenerateRequest:
    """The wire request; unset options take the server's defaults (greedy, 64 new tokens)."""
    req = generation_pb2.GenerateRequest(
        prompt=prompt or "",
        input_ids=list(input_ids or ()),
        stop=list(stop),
        stop_token_ids=list(stop_token_ids),
        ignore_eos=ignore_eos,
        logprobs=logprobs,
        lora=lora,
        request_id=request_id,
        prompt_logprobs=prompt_logprobs,
    )
    for name, value in (
        ("max_new_tokens", max_new_tokens),
        ("temperature", temperature),
        ("top_p", top_p),
        ("top_k", top_k),
        ("seed", seed),
    ):
        if value is not None:
            setattr(req, name, value)
    return req


def to_chunk(resp: generation_pb2.GenerateResponse) -> Chunk:
    finish = None
    usage = None
    if resp.finish_reason != generation_pb2.FINISH_REASON_UNSPECIFIED:
        finish = generation_pb2.FinishReason.Name(resp.finish_reason).lower()
        usage = Usage(resp.usage.prompt_tokens, resp.usage.completion_tokens, resp.usage.cached_tokens)
    prompt = list(resp.prompt_logprobs) if resp.prompt_logprobs else None
    return Chunk(list(resp.token_ids), resp.text, list(resp.logprobs), finish, usage, resp.request_id, prompt)


class _Collector:
    def __init__(self, want_logprobs: bool) -> None:
        self.want_logprobs = want_logprobs
        self.ids: list[int] = []
        self.text: list[str] = []
        self.logprobs: list[float] = []
        self.last: Chunk | None = None
        self.n = 0
        self.prompt_logprobs: list[float] | None = None

    def add(self, c: Chunk) -> None:
        if c.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = c.prompt_logprobs
        self.ids += c.token_ids
        self.text.append(c.text)
        self.logprobs += c.logprobs
        self.last, self.n = c, self.n + 1

    def result(self) -> Completion:
        last = self.last
        assert last is not None and last.finish_reason is not None and last.usage is not None, (
            "the stream ended without a final chunk"
        )
        return Completion(
            self.ids,
            "".join(self.text),
            last.finish_reason,
            last.usage,
            self.logprobs if self.want_logprobs else None,
            last.request_id,
            self.n,
            self.prompt_logprobs,
        )


class RpcStatus(grpc.RpcError):
    """What callers of a ``grpc.RpcError`` read, kept on the client's typed errors."""

    _code: grpc.StatusCode = grpc.StatusCode.UNKNOWN
    _details: str = ""

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


_TYPED: dict[type[errors.ExpertMeshError], type] = {}


def typed_error(e: grpc.RpcError, tls: TLSConfig | None = None) -> errors.ExpertMeshError:
    """The :mod:`expertmesh.errors` type of ``e``'s status, also a ``grpc.RpcError``; its
    message is the server's details (plus a hint when a plaintext client met a TLS server)."""
    base = from_rpc_error(e)
    cls = _TYPED.get(type(base))
    if cls is None:
        cls = _TYPED[type(base)] = type(
            type(base).__name__, (type(base), RpcStatus), {"__module__": __name__}
        )
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
    details = base.message + _tls.plaintext_hint(code, base.message, tls)
    err = cls(details)
    err._code, err._details = code, details
    err.status = base.status  # NOTE: kept for statuses without a class of their own
    return err


def _options(max_message_mb: int) -> list[tuple[str, int]]:
    n = max_message_mb << 20
    return [("grpc.max_receive_message_length", n), ("grpc.max_send_message_length", n)]


class Client:
    def __init__(
        self, addr: str, timeout: float | None = None, max_message_mb: int = 64, tls: TLSConfig | None = None
    ) -> None:
        """``timeout``: seconds for a whole generation (None = no deadline). ``tls``: talk TLS
        (``TLSConfig(ca=...)`` to verify the coordinator's certificate against a private CA)."""
        self.addr, self.timeout, self.tls = addr, timeout, tls
        self.channel = _tls.channel(addr, tls, _options(max_message_mb))
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)

    def stream(
        self, prompt: str | None = None, input_ids: Sequence[int] | None = None, **kw
    ) -> Iterator[Chunk]:
        """The completion's pieces as they come (same arguments as :meth:`generate`)."""
        call = self.stub.Generate(build_request(prompt, input_ids, **kw), timeout=self.timeout)
        try:
            for resp in call:
                yield to_chunk(resp)
        except grpc.RpcError as e:
            raise typed_error(e, self.tls) from None
        finally:
            call.cancel()  # no-op when finished; frees the server's pages when left early

    def generate(self, prompt: str | None = None, input_ids: Sequence[int] | None = None, **kw) -> Completion:
        """One whole completion of ``prompt`` (text) or ``input_ids`` (token ids; give one of
        the two). Keyword options, unset ones taking the coordinator's defaults:

        - ``max_new_tokens`` (int): tokens to generate at most (the coordinator's default, 64
          unless ``--default-max-new-tokens`` says otherwise);
        - ``temperature`` (float, 0 = greedy, the default), ``top_p`` (float in (0, 1]),
          ``top_k`` (int, 0 = no limit), ``seed`` (int: the same seed gives the same tokens);
        - ``stop`` (strings that end the completion, cut from its text), ``stop_token_ids``,
          ``ignore_eos`` (bool: go on past the end-of-sequence token);
        - ``logprobs`` (bool): each token's log-probability in ``Completion.logprobs``;
        - ``prompt_logprobs`` (bool): each prompt token's, from the second on, given the tokens
          before it, in ``Completion.prompt_logprobs`` (``max_new_tokens=0`` then scores the
          prompt alone);
        - ``lora`` (str): the name of a loaded MoE LoRA adapter ("" = the base model);
        - ``request_id`` (str): a name for the request in the coordinator's logs.

        Raises the typed errors of :mod:`expertmesh.errors` (see the module's docstring)."""
        col = _Collector(bool(kw.get("logprobs")))
        for c in self.stream(prompt, input_ids, **kw):
            col.add(c)
        return col.result()

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient:
    def __init__(
        self, addr: str, timeout: float | None = None, max_message_mb: int = 64, tls: TLSConfig | None = None
    ) -> None:
        self.addr, self.timeout, self.tls = addr, timeout, tls
        self.channel = _tls.aio_channel(addr, tls, _options(max_message_mb))
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)

    async def stream(
        self, prompt: str | None = None, input_ids: Sequence[int] | None = None, **kw
    ) -> AsyncIterator[Chunk]:
        """As :meth:`Client.stream`."""
        call = self.stub.Generate(build_request(prompt, input_ids, **kw), timeout=self.timeout)
        try:
            async for resp in call:
                yield to_chunk(resp)
        except grpc.RpcError as e:
            raise typed_error(e, self.tls) from None
        finally:
            call.cancel()

    async def generate(
        self, prompt: str | None = None, input_ids: Sequence[int] | None = None, **kw
    ) -> Completion:
        """As :meth:`Client.generate`."""
        col = _Collector(bool(kw.get("logprobs")))
        async for c in self.stream(prompt, input_ids, **kw):
            col.add(c)
        return col.result()

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
