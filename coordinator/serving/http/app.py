"""The coordinator's HTTP API as a FastAPI app: OpenAI-compatible ``/v1/models``,
``/v1/completions``, ``/v1/chat/completions``, plus ``/health`` and Prometheus ``/metrics``.

Every error is OpenAI's error JSON (``{"error": {"message", "type", "param", "code"}}``) with
the matching HTTP status: 400 for bad parameters (pydantic's validation errors included, where
FastAPI would say 422), 404 for an unknown model, 503 while the expert servers are not ready.
Non-streaming requests are cancelled when the client disconnects, as streaming ones are.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from coordinator.lora import AdapterError
from coordinator.lora.service import (
    AdapterNameError,
    AdapterSlotsFull,
    LoRANotFound,
    LoRAPermissionError,
    LoRAPushError,
)
from coordinator.serving.http.limits import BodyLimit
from coordinator.serving.http.protocol import APIError, ChatCompletionRequest, CompletionRequest, ErrorType
from coordinator.serving.http.serving import Serving, adapter_names
from expertmesh import auth
from expertmesh.errors import Unauthenticated


def create_app(coord: Any, model_name: str | None = None) -> FastAPI:
    name = model_name or Path(coord.config.model_dir).resolve().name
    serving = Serving(coord, name)
    created = int(time.time())
    app = FastAPI(title="expertmesh", docs_url=None, redoc_url=None, openapi_url=None)
    # 413 beyond --max-http-body-bytes, 400 for a body that is not UTF-8
    app.add_middleware(
        BodyLimit, max_bytes=coord.request_limits.input.max_body_bytes, on_refused=coord.metrics.invalid
    )

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        # NOTE: unknown routes and methods answer OpenAI's error object, as every other error
        kind: ErrorType = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        what = f"{request.method} {request.url.path}: {exc.detail}"
        return JSONResponse(APIError(exc.status_code, what, kind).body(), status_code=exc.status_code)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        errs = exc.errors()
        first = errs[0] if errs else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        msg = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ())[1:])}: {e.get('msg')}" for e in errs)
        coord.metrics.invalid()
        return JSONResponse(APIError(400, msg or "invalid request body", param=param).body(), status_code=400)

    @app.get("/health")
    async def health() -> Response:
        if coord.serving():  # NOTE: the gRPC health service publishes the same function
            return Response(status_code=200)
        return JSONResponse(
            APIError(503, f"expert servers are not ready: {coord.expert_state()}", "service_unavailable_error").body(),
            status_code=503,
        )  # fmt: skip

    @app.get("/metrics")
    async def metrics() -> Response:
        body = await asyncio.to_thread(coord.metrics.exposition)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        max_len = coord.request_limits.max_context
        base = {"id": name, "object": "model", "created": created, "owned_by": "expertmesh", "root": name,
                "parent": None, "max_model_len": max_len}  # fmt: skip
        loras = [{**base, "id": a, "root": a, "parent": name} for a in adapter_names(coord)]
        return {"object": "list", "data": [base, *loras]}

    @app.post("/v1/load_lora_adapter")
    async def load_lora(body: LoRALoad, request: Request) -> Response:
        _admin_only(request, coord.config.admin_token)
        await _lora_call(coord.lora.load, body.lora_name, body.lora_path)
        return Response(f"adapter {body.lora_name!r} loaded", media_type="text/plain")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora(body: LoRAUnload, request: Request) -> Response:
        _admin_only(request, coord.config.admin_token)
        await _lora_call(coord.lora.unload, body.lora_name)
        return Response(f"adapter {body.lora_name!r} unloaded", media_type="text/plain")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        return await _respond(serving.completions(body), request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Any:
        return await _respond(serving.chat(body), request)

    return app


async def _respond(work: Awaitable[dict[str, Any] | AsyncIterator[str]], request: Request) -> Response:
    """Runs a handler; a whole response is abandoned (its requests cancelled) if the client
    disconnects first; a stream is cancelled by Starlette when the client goes away."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not task.done():  # NOTE: cancelling the task cancels its scheduler requests (run_jobs)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
    result = task.result()
    if isinstance(result, dict):
        return JSONResponse(result)
    return StreamingResponse(result, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


class LoRALoad(BaseModel):  # vLLM's body for the same endpoint
    lora_name: str
    lora_path: str


class LoRAUnload(BaseModel):
    lora_name: str


def _admin_only(request: Request, token: str | None) -> None:
    """Adapter loading is the admin plane, guarded like the Admin API: with an admin
    token the request must carry ``Authorization: Bearer TOKEN`` (401 without), without one only
    loopback peers may (403). Paths are further confined to --lora-dir by the LoRA service."""
    if token:
        try:
            auth.check_token(token, request.headers.items(), "the admin endpoints")
        except Unauthenticated as e:
            raise APIError(401, e.message, code="invalid_api_key") from None
        return
    host = request.client.host if request.client is not None else ""
    if not auth.is_loopback_host(host):
        raise APIError(
            403,
            f"adapter loading is allowed from loopback only, not {host} (start the coordinator with "
            f"--admin-token or {auth.ADMIN_TOKEN_ENV} to allow it with the token)",
            "permission_error",
        )


_LORA_HTTP = ((LoRAPermissionError, 403), (LoRANotFound, 404), (AdapterError, 400), (LoRAPushError, 503),
              (TimeoutError, 504))  # fmt: skip


# the request field each refusal is about (first match); an AdapterError otherwise is the
# adapter found at lora_path (unreadable, malformed, not made for this model)
_LORA_PARAM = ((LoRAPermissionError, "lora_path"), (AdapterNameError, "lora_name"), (AdapterSlotsFull, None),
               (LoRANotFound, "lora_name"), (TimeoutError, "lora_name"), (AdapterError, "lora_path"))  # fmt: skip


async def _lora_call(fn: Any, *args: str) -> None:
    try:
        await asyncio.to_thread(fn, *args)
    except tuple(kind for kind, _ in _LORA_HTTP) as e:
        status = next(code for kind, code in _LORA_HTTP if isinstance(e, kind))
        param = next((p for kind, p in _LORA_PARAM if isinstance(e, kind)), None)
        raise APIError(status, e.args[0] if e.args else str(e), param=param) from None


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
