"""``--dry-run``: show what a recipe would do, without training.

Sections: the plan (layout, batch sizes, paths); the data (built exactly as a run builds it, so
every data check runs); the model and its DataPacker with the first item packed as the rollout
engine would receive it; and the fully resolved recipe.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tomli_w

from runner.recipe.algos import spec_of
from runner.recipe.plan import RunPlan
from runner.recipe.resolved import recipe_hash, resolved_document
from runner.recipe.rules import env_enabled
from runner.recipe.schema import Recipe


def plan_sections(recipe: Recipe, plan: RunPlan) -> list[tuple[str, list[tuple[str, str]]]]:
    """The (title, rows) sections of the dry-run."""
    from runner.data.preview import describe_data

    sections = [("Plan", plan.rows() + pipeline_rows(recipe) + precision_rows(recipe)
                 + [("recipe hash", recipe_hash(recipe)[:16])]),
                ("Data", describe_data(recipe))]
    packing: dict[str, Any] = {}
    sections.append(("Model and packing", packing_rows(recipe, packing)))
    if packing.get("item") is not None and env_enabled(recipe):
        sections.append(("One episode (played with the current model)",
                         episode_rows(recipe, packing["path"], packing["packer"],
                                      packing["item"])))
    return sections + [("Memory (estimated from the model folders)", memory_rows(recipe, plan))]


def memory_rows(recipe: Recipe, plan: RunPlan) -> list[tuple[str, str]]:
    """Per rank, the bytes of the models' parameters, gradients and optimizer state, with and
    without sharding, and the device's memory where it reports it."""
    from runner.preflight import estimate_state

    return estimate_state(recipe, plan.world_size).rows()


def pipeline_rows(recipe: Recipe) -> list[tuple[str, str]]:
    """How far rollouts run ahead of training (``algo.max_off_policy_steps``), and where."""
    k = getattr(recipe.algo, "max_off_policy_steps", None)
    if k is None:
        return []
    if k == 0:
        return [("rollouts ahead", "0: each step samples, then trains (synchronous)")]
    import torch

    return [("rollouts ahead", f"{k} batch(es): step t trains a batch sampled by the policy of "
             f"step t - {k} or later, while a producer thread of each rank samples step "
             f"t + {k}'s batch with its own engine"
             f"{' and rewards it' if spec_of(recipe).trains_on_rewards else ''}"
             + ("; dynamic sampling draws each step's batches there (up to "
                f"algo.max_sample_batches = {recipe.algo.max_sample_batches}), the ranks' "
                "producers deciding together over a process group of their own"
                if getattr(recipe.algo, "dynamic_sampling", "off") == "filter" else "")),
            ("producer threads", f"the producer samples with {n} torch thread(s) "
             f"(rollout.producer_threads), the training with {torch.get_num_threads()}"
             if (n := recipe.rollout.producer_threads) else
             f"the producer and the training each use torch's {torch.get_num_threads()} "
             "thread(s) (rollout.producer_threads = 0)")]


def precision_rows(recipe: Recipe) -> list[tuple[str, str]]:
    """What the trained models and the engine compute in on this machine, and why."""
    from runner.precision import resolve, shares_policy

    p = resolve(recipe)
    rows = [("precision", p.train_label)]
    if spec_of(recipe).samples_online:
        rows.append(("rollout dtype", p.engine_dtype))
        if recipe.rollout.engine == "hf":
            rows.append(("rollout weights", "the policy's own model (rollout.share_policy)"
                         if shares_policy(recipe, p) else "a copy, given the policy's weights "
                         "after each update"))
    activations = ("recomputed in the backward pass, one layer at a time "
                   "(train.gradient_checkpointing)" if recipe.train.gradient_checkpointing
                   else "kept for the backward pass (train.gradient_checkpointing = false)")
    forwards = ("compiled (train.compile): training and scoring forwards and the hf engine's "
                "generation (text models) through torch.compile, at their first call"
                if recipe.train.compile
                else "eager (train.compile = false)")
    return rows + [("precision chosen because", p.why), ("activations", activations),
                   ("forwards", forwards)]


def packing_rows(recipe: Recipe, built: dict[str, Any] | None = None
                 ) -> list[tuple[str, str]]:
    """Build the model folder and the student's packer; check every prompt's length as a run
    does before it trains (``runner.rollout.lengths.run_limit``); pack the first training
    item. ``built`` (if given) receives the model folder, the packer and that item."""
    from runner.data.preference import DatasetPreferenceEnv
    from runner.data.sources import build_prompt_sources
    from runner.models import load_tokenizer, read_model_type, resolve_model_path
    from runner.packers import build_packer
    from runner.recipe.reward_names import model_rewards
    from runner.rollout.lengths import run_limit
    from runner.types import ObsBundle

    path = resolve_model_path(recipe.model.path)
    model_type = recipe.model.model_type or read_model_type(path)
    packer = build_packer(path, model_type, recipe.data_packer.factory,
                          trust_remote_code=recipe.model.trust_remote_code,
                          dtype=recipe.model.dtype)
    rows = [("model", f"{recipe.model.path} -> {path}"), ("model_type", model_type),
            ("data packer", f"{type(packer).__module__}.{type(packer).__qualname__}"
             + (f" (from {recipe.data_packer.factory})" if recipe.data_packer.factory else
                " (model_type registry)"))]
    if spec_of(recipe).stream == "pairs":
        pair = DatasetPreferenceEnv(recipe.data, seed=recipe.run.seed).train.pair(0)
        chosen, rejected = packer.get_preference_input(ObsBundle(pair.prompt, id=pair.id),
                                                       pair.chosen, pair.rejected)
        rows += [("chosen sequence",
                  repr(packer.decode(chosen.input_ids, skip_special_tokens=False))),
                 ("rejected sequence",
                  repr(packer.decode(rejected.input_ids, skip_special_tokens=False))),
                 ("tokens (chosen)", str(len(chosen.input_ids)))]
        return rows
    train, val = build_prompt_sources(recipe.data, recipe.algo.kind)
    if spec_of(recipe).stream == "conversations":
        return (rows + conversation_rows(recipe, packer, train.item(0))
                + budget_rows(recipe, packer, train))
    held_out = [val.item(i) for i in range(len(val))] if val is not None else []
    tokenizer = load_tokenizer(path, trust_remote_code=recipe.model.trust_remote_code)
    limit = run_limit(recipe, path, packer, tokenizer, [s for s in (train, val) if s is not None],
                      held_out)  # every prompt it can check, before one is packed
    item, max_new = train.item(0), recipe.rollout.max_new_tokens
    limit.check_item(item, max_new)
    rollout_input = packer.get_rollout_input(item)
    limit.check_tokens(len(packer.engine_prompt(rollout_input).full_ids), max_new,
                       item.origin.where, item.origin.prompt_column)
    rows += packer.describe_rollout_input(rollout_input)
    if built is not None:
        built.update(path=path, packer=packer, item=item)
    rows.append(("rollout max_model_len", f"{limit.max_model_len or 'the engine default'} "
                 f"({limit.why})"))
    for m in spec_of(recipe).models(recipe.algo):
        note = f" ({m.note})" if m.note else ""
        rows.append((m.role, f"{m.path} -> {resolve_model_path(m.path)}{note}"))
    separate = recipe.launch.backend == "ray" and recipe.launch.placement == "separate"
    where = ("in a Ray actor of its own, which every rank calls" if separate
             else "in the rank's process, on its device")
    for key, reward_path in model_rewards(recipe.reward.functions):
        rows.append((f"reward model ({key})", f"{reward_path} -> "
                     f"{resolve_model_path(reward_path, key=key)} (frozen; scores each rank's "
                     f"completions {where})"))
    return rows


def conversation_rows(recipe: Recipe, packer: Any, item: Any) -> list[tuple[str, str]]:
    """The first training conversation as the template renders it, in runs of trained and
    untrained tokens (SFT's ``algo.loss_on``)."""
    from runner.data.conversations import conversation_of

    x = packer.get_conversation_input(conversation_of(item), recipe.algo.loss_on,
                                      list(item.tools) or None)
    runs = token_runs(x.input_ids, x.loss_mask)
    rows = [(f"{'trained' if trained else 'not trained'}, {len(ids)} tokens",
             repr(packer.decode(ids, skip_special_tokens=False))) for trained, ids in runs]
    return rows + [("conversation tokens", f"{len(x.input_ids)} ({sum(x.loss_mask)} trained)")]


def budget_rows(recipe: Recipe, packer: Any, source: Any) -> list[tuple[str, str]]:
    """With ``train.max_tokens_per_microbatch``: how the first step's worth of conversations of
    one rank (the source's first ones, in its order) packs, and the share of the micro-batches'
    budget their tokens fill (an oversize conversation's micro-batch counting its own)."""
    from runner.data.conversations import conversation_of
    from runner.train.loops.batches import pack_by_tokens

    budget = recipe.train.max_tokens_per_microbatch
    if budget <= 0:
        return []
    world = recipe.launch.num_processes if recipe.launch.backend != "local" else 1
    n = min(len(source), max(1, recipe.algo.examples_per_step // world))
    items = [source.item(i) for i in range(n)]
    lengths = [len(packer.get_conversation_input(conversation_of(item), recipe.algo.loss_on,
                                                 list(item.tools) or None).input_ids)
               for item in items]
    pieces = pack_by_tokens(lengths, budget)
    capacity = sum(max(budget, sum(lengths[i] for i in p)) for p in pieces)
    return [("packing", f"the source's first {n} conversations (one rank's step): "
             f"{len(pieces)} micro-batch(es) of up to {budget} tokens, "
             f"{sum(lengths) / capacity:.0%} of the budget filled (real tokens / budget)")]


def show_dry_run(recipe: Recipe, plan: RunPlan, *, source: str, overrides: Sequence[str],
                 plain: bool) -> None:
    from rich.console import Console
    from rich.syntax import Syntax
    from rich.table import Table

    console = Console(no_color=plain, force_terminal=False if plain else None)
    doc = resolved_document(recipe, overrides, source)
    doc.pop("resolved")
    console.print(f"[bold]{source}[/bold]: dry run of {recipe.run.name!r} (nothing is trained)")
    for title, rows in plan_sections(recipe, plan):
        table = Table(title=title, show_header=False, title_justify="left")
        table.add_column(style="bold cyan")
        table.add_column(overflow="fold")
        for key, value in rows:
            table.add_row(key, value)
        console.print(table)
    console.print("[bold]Resolved recipe[/bold]")
    if plain:
        console.print(tomli_w.dumps(doc), markup=False, highlight=False)
    else:
        console.print(Syntax(tomli_w.dumps(doc), "toml", theme="ansi_dark"))


def spans(result: Any) -> list[tuple[bool, list[int]]]:
    """The episode's completion tokens as runs of (trained, ids): the engine's tokens are
    trained, the environment's are not.

    >>> from runner.envs.episodes import EpisodeResult
    >>> from runner.rollout.base import Completion
    >>> r = EpisodeResult((1,), Completion((5, 6, 2, 7, 8, 9), "", (0.0,) * 6, "stop"),
    ...                   (1, 1, 1, 0, 0, 1), 0.0, {}, ())
    >>> spans(r)
    [(True, [5, 6, 2]), (False, [7, 8]), (True, [9])]
    """
    return token_runs(result.completion.token_ids, result.loss_mask)


def token_runs(ids: Sequence[int], mask: Sequence[int]) -> list[tuple[bool, list[int]]]:
    """``ids`` as runs of (trained, ids) by their 0/1 ``mask``."""
    out: list[tuple[bool, list[int]]] = []
    for token, m in zip(ids, mask, strict=True):
        if out and out[-1][0] == bool(m):
            out[-1][1].append(token)
        else:
            out.append((bool(m), [token]))
    return out


def episode_rows(recipe: Recipe, model_path: Any, packer: Any, item: Any) -> list[tuple[str, str]]:
    """Play one episode of ``item`` with the model at ``model_path`` (in-process transformers,
    whatever ``rollout.engine`` says: a preview needs no server) and describe it."""
    from runner.envs.build import build_env_runner
    from runner.rollout.hf import HFEngine
    from runner.train.assembly.seeds import item_seed
    from runner.train.loops.rollouts import sampling

    runner = build_env_runner(recipe, packer)
    engine = HFEngine.from_path(str(model_path), dtype="float32", batch_size=1,
                                trust_remote_code=recipe.model.trust_remote_code)
    try:
        check = lambda tokens, max_new, item: None  # noqa: E731 - run_limit checked the prompts
        result = runner.play(engine.generate, check, [item], sampling(recipe.rollout, 1, 0),
                             [item_seed(recipe.run.seed, 1, 0)])[0]
    finally:
        engine.close()
        runner.close()
    rows = runner.describe()
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
