"""``--dry-run`` with ``[env]``: one episode played with the recipe's model, shown turn by turn
with the token spans the loss is taken on."""

from __future__ import annotations

from typing import Any

from runner.envs.episodes import EpisodeResult


def spans(result: EpisodeResult) -> list[tuple[bool, list[int]]]:
    """The episode's completion tokens as runs of (trained, ids): the engine's tokens are
    trained, the environment's are not.

    >>> from runner.rollout.base import Completion
    >>> r = EpisodeResult((1,), Completion((5, 6, 2, 7, 8, 9), "", (0.0,) * 6, "stop"),
    ...                   (1, 1, 1, 0, 0, 1), 0.0, {}, ())
    >>> spans(r)
    [(True, [5, 6, 2]), (False, [7, 8]), (True, [9])]
    """
    out: list[tuple[bool, list[int]]] = []
    for token, m in zip(result.completion.token_ids, result.loss_mask, strict=True):
        if out and out[-1][0] == bool(m):
            out[-1][1].append(token)
        else:
            out.append((bool(m), [token]))
    return out


def episode_rows(recipe: Any, model_path: Any, packer: Any, item: Any) -> list[tuple[str, str]]:
    """Play one episode of ``item`` with the model at ``model_path`` (in-process transformers,
    whatever ``rollout.engine`` says: a preview needs no server) and describe it."""
    from runner.envs.build import build_env_runner
    from runner.rollout.hf import HFEngine
    from runner.train.rollouts import sampling
    from runner.train.seeds import item_seed

    runner = build_env_runner(recipe, packer)
    engine = HFEngine.from_path(str(model_path), dtype="float32", batch_size=1,
                                trust_remote_code=recipe.model.trust_remote_code)
    try:
        check = lambda tokens, max_new, item: None  # noqa: E731 - run_limit checked the prompts
        result = runner.play(engine.generate, check, [item], sampling(recipe.rollout, 1, 0),
                             [item_seed(recipe.run.seed, 1, 0)])[0]
    finally:
        engine.close()
    rows = [("environment", recipe.env.factory or "built-in tool environment"),
            ("tools", ", ".join(s["function"]["name"] for s in runner.tools.schemas) or "none")]
    rows += [(f"{m['role']}", repr(m["content"])) for m in result.messages]
    rows.append(("prompt tokens (not trained)", str(len(result.prompt_ids))))
    for trained, ids in spans(result):
        label = "trained (assistant)" if trained else "not trained (environment)"
        rows.append((f"{label}, {len(ids)} tokens",
                     repr(packer.decode(ids, skip_special_tokens=False))))
    s = result.stats
    rows.append(("episode", f"{int(s['turns'])} turn(s), {int(s['tool_calls'])} tool call(s) "
                 f"({int(s['tool_failures'])} failed), env reward {result.env_reward:g}"
                 + (", truncated" if s["truncated"] else "")))
    return rows
