"""The routes of ``posttrain-run serve`` (the app, its key check and its errors:
``runner.rollout.openai_server``): every request needs the server's key (random unless given)."""

from __future__ import annotations

import asyncio
import hmac
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from runner.rollout.openai_api import (
    Sampling,
    chat_body,
    chat_chunks,
    chat_request,
    completion_body,
    completion_request,
)
from runner.rollout.openai_server import api_app, body_of, events
from runner.serve.model import ServedModel


def make_app(model: ServedModel, api_key: str, name: str) -> FastAPI:
    """The app serving ``model`` as ``name`` to callers that present ``api_key``."""
    key = api_key.encode()
    app = api_app("posttrain-run serve",
                  lambda given: True if hmac.compare_digest(given.encode(), key) else None,
                  "a valid API key is needed (Authorization: Bearer KEY; serve printed it "
                  "when it started)")
    _routes(app, model, name)
    return app


def _routes(app: FastAPI, model: ServedModel, name: str) -> None:
    """The API's paths."""
    created = int(time.time())

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created,
                                            "owned_by": "posttrain-runner"}]}

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
            return events(chunks)
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
            return events(_completion_chunks(body, req.sampling))
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
