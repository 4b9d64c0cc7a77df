"""Runs the HTTP app with uvicorn inside the coordinator's own event loop (next to the gRPC
server), so handlers reach the scheduler directly.

The coordinator owns the process's signals: uvicorn's own SIGINT/SIGTERM capture is turned
off, and :meth:`HttpServer.stop` ends it when the coordinator stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Iterator
from typing import Any

import uvicorn

from coordinator.serving.http.app import create_app
from expertmesh.errors import BindError

log = logging.getLogger("expertmesh.http")


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # NOTE: the coordinator's loop handles SIGINT/SIGTERM and calls stop()


class HttpServer:
    def __init__(self, server: _Server, sock: socket.socket, task: asyncio.Task) -> None:
        self.server, self.sock, self.task = server, sock, task
        self.port = int(sock.getsockname()[1])

    async def stop(self, grace: float = 5.0) -> None:
        self.server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self.task), grace)
        except asyncio.TimeoutError:
            self.server.force_exit = True
            await self.task
        self.sock.close()


async def start_http(coord: Any, host: str, port: int) -> HttpServer:
    """Binds ``host:port`` (0 = a free port) and serves the coordinator's HTTP API."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise BindError(f"{host}:{port}", "--http-port", e.strerror or "") from None
    sock.set_inheritable(True)
    # HTTPS with the gRPC port's certificate when the coordinator has one (--tls-cert)
    tls = getattr(coord.config, "tls", None)
    ssl = {"ssl_certfile": tls.cert, "ssl_keyfile": tls.key} if tls is not None and tls.server_enabled else {}
    config = uvicorn.Config(
        create_app(coord),
        log_level="warning",
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=3,
        **ssl,  # type: ignore[arg-type]
    )
    server = _Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]), name="http-server")
    while not server.started and not task.done():
        await asyncio.sleep(0.01)
    if task.done():
        sock.close()
        task.result()  # raises what went wrong
        raise OSError("HTTP server stopped while starting")
    return HttpServer(server, sock, task)
