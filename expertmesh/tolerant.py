"""Registering a gRPC service whose request deserializers never raise: bytes that protobuf
refuses (corrupt wire format, a string that is not UTF-8) become an
:class:`~expertmesh.errors.InvalidRequest` value handed to the handler, so the client gets
INVALID_ARGUMENT with a message, not gRPC's UNKNOWN for a deserializer exception.

Unary-request handlers are wrapped to answer it themselves; a streaming-request handler (the
expert server's ``Forward``) receives it among its messages and must refuse it (and count it).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError, Message

from expertmesh.errors import InvalidRequest

__all__ = ["add_service", "parser"]


def parser(cls: type[Message]) -> Callable[[bytes], Message | InvalidRequest]:
    def parse(data: bytes) -> Message | InvalidRequest:
        try:
            return cls.FromString(data)
        except DecodeError as e:
            return InvalidRequest(f"malformed {cls.DESCRIPTOR.name}: not a valid protobuf message ({e})")

    return parse


def _refusing(fn: Callable[[Any, Any], Any], streams: bool) -> Callable[[Any, Any], Any]:
    if streams:  # server-streaming: an async generator

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, InvalidRequest):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            async for item in fn(request, context):
                yield item

        return stream

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Awaitable[Any]:
        if isinstance(request, InvalidRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        return await fn(request, context)

    return unary


def add_service(servicer: object, server: grpc.aio.Server, service: ServiceDescriptor) -> None:
    """Registers every method of ``service`` that ``servicer`` implements (the generated
    ``add_*Servicer_to_server`` with tolerant deserializers)."""
    handlers = {}
    for m in service.methods:
        req_cls = message_factory.GetMessageClass(m.input_type)
        resp_cls = message_factory.GetMessageClass(m.output_type)
        fn = getattr(servicer, m.name)
        kw = dict(request_deserializer=parser(req_cls), response_serializer=resp_cls.SerializeToString)
        if m.client_streaming and m.server_streaming:
            handlers[m.name] = grpc.stream_stream_rpc_method_handler(fn, **kw)
        elif m.client_streaming:
            handlers[m.name] = grpc.stream_unary_rpc_method_handler(fn, **kw)
        elif m.server_streaming:
            handlers[m.name] = grpc.unary_stream_rpc_method_handler(_refusing(fn, True), **kw)
        else:
            handlers[m.name] = grpc.unary_unary_rpc_method_handler(_refusing(fn, False), **kw)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)
