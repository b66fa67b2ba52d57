"""The HTTP side of ``posttrain-run serve``: a FastAPI app on uvicorn, bound to 127.0.0.1 only.

Every request needs ``Authorization: Bearer <key>`` (the key is random per server unless given);
without it the answer is 401. Errors are OpenAI's JSON error objects: a bad request is 400 naming
the field, an unknown path 404, anything else 500 with one line, and the server goes on.
``stream: true`` answers as server-sent events (``data: {chunk}`` lines, then ``data: [DONE]``).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from runner.errors import RunnerError, safe_line
from runner.serve.model import ServedModel
from runner.serve.protocol import (
    ApiError,
    Sampling,
    chat_body,
    chat_chunks,
    chat_request,
    completion_body,
    completion_request,
)

HOST = "127.0.0.1"


def make_app(model: ServedModel, api_key: str, name: str) -> FastAPI:
    """The app serving ``model`` as ``name`` to callers that present ``api_key``."""
    app = FastAPI(title="posttrain-run serve", docs_url=None, redoc_url=None, openapi_url=None)
    _guard(app, api_key)
    _routes(app, model, name)
    return app


def _error(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


def _guard(app: FastAPI, api_key: str) -> None:
    """The key check, and every error as OpenAI's error object."""
    error = _error

    @app.middleware("http")
    async def authorize(request: Request, call_next: Callable[[Request], Awaitable[Response]]
                        ) -> Response:
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            return error(ApiError(401, "a valid API key is needed (Authorization: Bearer KEY; "
                                  "serve printed it when it started)", None,
                                  "authentication_error"))
        try:
            return await call_next(request)
        except ApiError as exc:
            return error(exc)
        except Exception as exc:  # one line, and the server goes on
            return error(ApiError(500, safe_line(f"{type(exc).__name__}: {exc}"), None,
                                  "server_error"))

    @app.exception_handler(ApiError)
    async def refused(request: Request, exc: ApiError) -> JSONResponse:
        return error(exc)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return error(ApiError(exc.status_code, f"{request.method} {request.url.path}: "
                              f"{exc.detail}", None, "invalid_request_error"))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error(ApiError(400, safe_line(str(exc)), None))


def _routes(app: FastAPI, model: ServedModel, name: str) -> None:
    """The API's paths."""
    created = int(time.time())

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created,
                                            "owned_by": "posttrain-runner"}]}

    async def body_of(request: Request) -> Any:
        try:
            return json.loads(await request.body())
        except (ValueError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"the request body is not JSON ({exc})") from exc

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        req = chat_request(await body_of(request), model.recipe.rollout.max_new_tokens,
                           model.max_new_tokens)
        prompt = model.chat_prompt(req)
        output = (await asyncio.wrap_future(model.submit(prompt, req.sampling)))[0]
        choices = model.choices(output, req.sampling, chat=True, tools=bool(req.tools))
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        if req.sampling.stream:
            chunks = chat_chunks(rid, int(time.time()), name, prompt, choices, req.sampling)
            return _events(chunks)
        return JSONResponse(chat_body(rid, int(time.time()), name, prompt, choices,
                                      req.sampling.logprobs))

    @app.post("/v1/completions")
    async def complete(request: Request) -> Response:
        req = completion_request(await body_of(request), model.recipe.rollout.max_new_tokens,
                                 model.max_new_tokens)
        prompt = model.text_prompt(req.prompt)
        output = (await asyncio.wrap_future(model.submit(prompt, req.sampling)))[0]
        choices = model.choices(output, req.sampling, chat=False, tools=False)
        rid = f"cmpl-{uuid.uuid4().hex}"
        body = completion_body(rid, int(time.time()), name, prompt, choices,
                               req.sampling.logprobs)
        if req.sampling.stream:
            return _events(_completion_chunks(body, req.sampling))
        return JSONResponse(body)


def _completion_chunks(body: dict[str, Any], sampling: Sampling) -> list[dict[str, Any]]:
    """A streamed completion: each choice's text in one chunk, then its finish reason."""
    head = {k: body[k] for k in ("id", "object", "created", "model")}
    chunks = []
    for c in body["choices"]:
        chunks.append({**head, "choices": [{**c, "finish_reason": None}]})
        chunks.append({**head, "choices": [{"index": c["index"], "text": "",
                                            "finish_reason": c["finish_reason"],
                                            "logprobs": None}]})
    if sampling.include_usage:
        chunks.append({**head, "choices": [], "usage": body["usage"]})
    return chunks


def _events(chunks: list[dict[str, Any]]) -> StreamingResponse:
    def lines() -> Iterator[str]:
        for chunk in chunks:
            yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(lines(), media_type="text/event-stream")


def listen(port: int) -> socket.socket:
    """A socket listening on 127.0.0.1:``port`` (0: a free port), for uvicorn to serve on."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((HOST, port))
    except OSError as exc:
        sock.close()
        raise RunnerError(f"serve: cannot listen on {HOST}:{port} ({exc.strerror})") from exc
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def run_server(app: FastAPI, sock: socket.socket) -> None:
    """Serve ``app`` on ``sock`` until SIGINT or SIGTERM (uvicorn's own handling: requests in
    progress finish, then it returns)."""
    import uvicorn

    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                            timeout_graceful_shutdown=10)
    uvicorn.Server(config).run(sockets=[sock])
