"""The HTTP side shared by the runner's OpenAI-compatible endpoints (``posttrain-run serve`` and
the agents' endpoint of ``[env] agent``): a FastAPI app on uvicorn, bound to 127.0.0.1 only.

Every request needs ``Authorization: Bearer <key>``; the app's ``who`` turns a key into the
caller (None: 401). Errors are OpenAI's JSON error objects: a bad request is 400 naming the
field, an unknown path 404, anything else 500 with one line, and the server goes on.
``stream: true`` answers as server-sent events (``data: {chunk}`` lines, then ``data: [DONE]``).
"""

from __future__ import annotations

import json
import signal
import socket
import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from runner.errors import RunnerError, safe_line
from runner.rollout.openai_api import ApiError

HOST = "127.0.0.1"
CALLER = "caller"  # request.state's attribute: what ``who`` returned for the request's key


def api_app(title: str, who: Callable[[str], Any], refusal: str) -> FastAPI:
    """An app whose every request presents a key ``who`` knows (``refusal``: the 401's text);
    errors answered as OpenAI's error objects."""
    app = FastAPI(title=title, docs_url=None, redoc_url=None, openapi_url=None)

    @app.middleware("http")
    async def authorize(request: Request, call_next: Callable[[Request], Awaitable[Response]]
                        ) -> Response:
        given = request.headers.get("authorization", "")
        caller = who(given[len("Bearer "):]) if given.startswith("Bearer ") else None
        if caller is None:
            return error(ApiError(401, refusal, None, "authentication_error"))
        setattr(request.state, CALLER, caller)
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

    return app


def error(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


async def body_of(request: Request) -> Any:
    """The request's JSON body (400 when it is not JSON)."""
    try:
        return json.loads(await request.body())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the request body is not JSON ({exc})") from exc


def events(chunks: list[dict[str, Any]]) -> StreamingResponse:
    """Chunks as server-sent events, then ``[DONE]``."""
    def lines() -> Iterator[str]:
        for chunk in chunks:
            yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(lines(), media_type="text/event-stream")


def listen(port: int, what: str = "serve") -> socket.socket:
    """A socket listening on 127.0.0.1:``port`` (0: a free port), for uvicorn to serve on."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((HOST, port))
    except OSError as exc:
        sock.close()
        raise RunnerError(f"{what}: cannot listen on {HOST}:{port} ({exc.strerror})") from exc
    sock.listen(128)
    return sock


def run_server(app: FastAPI, sock: socket.socket) -> None:
    """Serve ``app`` on ``sock`` until SIGINT or SIGTERM (uvicorn's own handling: requests in
    progress finish, then it returns)."""
    import uvicorn

    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                            timeout_graceful_shutdown=10)
    server = uvicorn.Server(config)
    server.run(sockets=[sock])
    # uvicorn re-raises the signal it stopped on through the handler it found, which under
    # asyncio.run is asyncio's own: that one only cancels the main task, which may have finished
    # by then, and Ctrl-C would exit 0. A SIGINT that stopped the server is a KeyboardInterrupt.
    if signal.SIGINT in getattr(server, "_captured_signals", ()):
        raise KeyboardInterrupt


class Background:
    """``app`` served on a thread of this process (no signal handlers of its own) until
    ``stop``; ``url`` is its base URL (``http://127.0.0.1:PORT/v1``)."""

    def __init__(self, app: FastAPI) -> None:
        import uvicorn

        self.sock = listen(0, "the agents' endpoint")
        self.url = f"http://{HOST}:{self.sock.getsockname()[1]}/v1"
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
        self.server = uvicorn.Server(config)
        self.server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="agents-endpoint", daemon=True)
        self.thread.start()
        while not self.server.started and self.thread.is_alive():
            threading.Event().wait(0.01)

    def stop(self) -> None:
        """Stop serving: requests in progress get 10 s to finish, then connections are cut."""
        self.server.should_exit = True
        self.thread.join(timeout=10)
        if self.thread.is_alive():
            self.server.force_exit = True
            self.thread.join(timeout=5)
        self.sock.close()
