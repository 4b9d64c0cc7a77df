"""Bounds on an HTTP request body, ahead of FastAPI (a plain ASGI middleware): a body larger than
``max_bytes`` is refused with 413 before it is read further (``Content-Length`` is checked
first, a chunked body is counted as it arrives), and a body that is not UTF-8 with 400, both as
OpenAI's error JSON (FastAPI would answer the latter ``{"detail": ...}``).

The body is read here, at most ``max_bytes`` of it, and replayed to the app; afterwards the
app's ``receive`` reaches the server's again (app.py watches it for a disconnect).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from coordinator.serving.http.protocol import APIError

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_WITH_BODY = frozenset({"POST", "PUT", "PATCH"})


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int, on_refused: Callable[[], None] | None = None) -> None:
        assert max_bytes > 0, f"{max_bytes=}"
        self.app, self.max_bytes, self.on_refused = app, max_bytes, on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in _WITH_BODY:
            await self.app(scope, receive, send)
            return
        length = _header(scope, b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            await self._refuse(send, self._too_large(length.decode("latin-1")[:20]))
            return
        chunks, n = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return  # the client left before sending the whole body
            part = msg.get("body", b"")
            n += len(part)
            if n > self.max_bytes:
                await self._refuse(send, self._too_large(f"more than {self.max_bytes}"))
                return
            chunks.append(part)
            if not msg.get("more_body", False):
                break
        body = b"".join(chunks)
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as e:
            await self._refuse(
                send, APIError(400, f"request body is not valid UTF-8 ({e.reason} at byte {e.start})")
            )
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    def _too_large(self, size: str) -> APIError:
        msg = f"request body of {size} bytes exceeds the limit of {self.max_bytes} bytes (--max-http-body-bytes)"
        return APIError(413, msg)

    async def _refuse(self, send: Send, err: APIError) -> None:
        if self.on_refused is not None:
            self.on_refused()
        payload = json.dumps(err.body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
        if err.status == 413:
            headers.append((b"connection", b"close"))  # the rest of the body is not read
        await send({"type": "http.response.start", "status": err.status, "headers": headers})
        await send({"type": "http.response.body", "body": payload})


def _header(scope: Scope, name: bytes) -> bytes | None:
    for k, v in scope.get("headers", ()):
        if k.lower() == name:
            return bytes(v).strip()
    return None
