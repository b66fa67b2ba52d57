"""``posttrain-run serve``: the recipe's policy (its engine, DataPacker and chat template, built
as a run builds them) behind an OpenAI-compatible endpoint on 127.0.0.1: ``model.py`` the engine
and its request queue, ``app.py`` the routes (the API's requests and answers:
``runner.rollout.openai_api``; the HTTP server: ``runner.rollout.openai_server``)."""

from __future__ import annotations

import secrets
from collections.abc import Callable
from pathlib import Path

from runner.recipe.schema import Recipe


def serve(recipe: Recipe, checkpoint: Path | None, *, port: int = 0, api_key: str = "",
          name: str = "", say: Callable[[str], None] = print) -> int:
    """Build the model, listen on 127.0.0.1:``port`` and answer until SIGINT or SIGTERM;
    returns the exit code (0)."""
    from runner.rollout.openai_server import HOST, listen, run_server
    from runner.serve.app import make_app
    from runner.serve.model import ServedModel

    key = api_key or f"sk-{secrets.token_urlsafe(24)}"
    name = name or (recipe.run.name if checkpoint is None
                    else f"{recipe.run.name}/{checkpoint.name}")
    model = ServedModel(recipe, checkpoint)
    try:
        sock = listen(port)
        bound = sock.getsockname()[1]
        say(f"serving {name} at http://{HOST}:{bound}/v1 (api key: {key}); Ctrl-C stops it")
        run_server(make_app(model, key, name), sock)
        say("serve: stopped")
    finally:
        model.close()
    return 0
