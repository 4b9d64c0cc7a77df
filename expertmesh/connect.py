"""How the ``expertmesh`` client commands reach a coordinator: ``--addr``, TLS (``--tls-ca``,
``--tls-cert``/``--tls-key``, ``--tls-server-name``) and, for the admin verbs, ``--admin-token``
(or env ``EXPERTMESH_ADMIN_TOKEN``), sent with every call as ``authorization: Bearer TOKEN``.

    channel = open_channel(args)          # after add_arguments(parser, admin=True)
    stub = admin_pb2_grpc.AdminStub(channel)
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any, NamedTuple

import grpc

from expertmesh import auth
from expertmesh.tls import TLSConfig


def add_arguments(p: argparse.ArgumentParser, admin: bool, default_addr: str = "127.0.0.1:50051") -> None:
    p.add_argument("--addr", default=default_addr, help="coordinator HOST:PORT")
    if admin:
        p.add_argument(
            "--admin-token",
            default=None,
            help=f"the coordinator's admin token (default: env {auth.ADMIN_TOKEN_ENV}); prefer the "
            "environment variable: a flag is visible to every user in `ps`",
        )
    TLSConfig.add_arguments(p, "client")


def admin_token(args: argparse.Namespace) -> str | None:
    return getattr(args, "admin_token", None) or auth.token_from_env(auth.ADMIN_TOKEN_ENV)


class _Details(NamedTuple):
    method: str
    timeout: float | None
    metadata: Any
    credentials: Any
    wait_for_ready: Any
    compression: Any


class _Bearer(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds the token's metadata to every call (the stubs' callers need not pass it)."""

    def __init__(self, token: str) -> None:
        self.extra = auth.metadata(token)

    def _details(self, d: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        md = [*(d.metadata or ()), *self.extra]
        wait = getattr(d, "wait_for_ready", None)
        compression = getattr(d, "compression", None)
        return _Details(d.method, d.timeout, md, d.credentials, wait, compression)  # type: ignore[return-value]

    def _call(self, continuation: Callable, details: grpc.ClientCallDetails, request: Any) -> Any:
        return continuation(self._details(details), request)

    intercept_unary_unary = intercept_unary_stream = _call  # type: ignore[assignment]
    intercept_stream_unary = intercept_stream_stream = _call  # type: ignore[assignment]


def open_channel(args: argparse.Namespace, options: list[tuple[str, Any]] | None = None) -> grpc.Channel:
    """A channel to ``args.addr`` (TLS per the flags), carrying the admin token if there is one."""
    from expertmesh import tls

    channel = tls.channel(args.addr, TLSConfig.from_args(args), options or ())
    token = admin_token(args)
    return grpc.intercept_channel(channel, _Bearer(token)) if token else channel


def describe_error(e: grpc.RpcError, args: argparse.Namespace) -> str:
    """One line for a failed call: ``CODE: details``, with a hint when a plaintext client seems
    to have met a TLS server."""
    from expertmesh import tls

    details = e.details() or ""
    hint = tls.plaintext_hint(e.code(), details, TLSConfig.from_args(args))
    return f"{e.code().name}: {details}{hint if hint not in details else ''}"
