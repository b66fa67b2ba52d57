"""Cross-field rules of a recipe, as pure functions ``Recipe -> list[Problem]``.

They run before anything heavy is imported; each problem names the key path it is about. This
is the one place each rule is written: the data layer (``runner.data``) and the losses
(``runner.algorithms``) take a checked recipe and do not check these again.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

from runner.errors import Problem
from runner.recipe.algos import ALGORITHMS, spec_of, titles
from runner.recipe.algos.spec import OWNED_KEY_HINTS
from runner.recipe.rules import env_enabled
from runner.recipe.rules import in_range as _range
from runner.recipe.rules import is_set as _set
from runner.recipe.schema import (
    DataConfig,
    LaunchConfig,
    LoggingConfig,
    Recipe,
    default_of,
)

# The built-in rewards a recipe may name instead of a dotted path. The recipe layer owns the
# names; ``runner.rewards.builtin.BUILTIN_REWARDS`` maps each to its function (a test holds the
# two together).
BUILTIN_REWARDS = ("arithmetic_exact", "format", "math_verify", "exact_match", "code_tests",
                   "code_tests_all")
_DOTTED_HINT = "write a dotted path like 'my_package.my_module.build'"


def check_prompt_source(r: Recipe) -> list[Problem]:
    """At most one of data.factory / data.path / data.name (for prompts and conversations;
    preference pairs: check_pair_source)."""
    if spec_of(r).stream == "pairs":
        return []
    chosen = [k for k in ("factory", "path", "name") if _set(getattr(r.data, k))]
    if len(chosen) > 1:
        keys = " and ".join(f"data.{k}" for k in chosen)
        return [Problem(f"data.{chosen[1]}", f"{keys} are mutually exclusive",
                        got={f"data.{k}": getattr(r.data, k) for k in chosen},
                        hint="keep one source and remove the others")]
    return []


# The override that turns each built-in DPO source off.
_OFF = {"jsonl_path": 'data.jsonl_path=""', "tar_path": 'data.tar_path=""',
        "synthetic_pairs": "data.synthetic_pairs=0"}


def check_pair_source(r: Recipe) -> list[Problem]:
    """One source of preference pairs (DPO): a factory or one of the built-in ones."""
    if spec_of(r).stream != "pairs":
        return []
    problems = []
    others = [k for k in ("jsonl_path", "tar_path", "synthetic_pairs") if _set(getattr(r.data, k))]
    if _set(r.data.factory) and others:
        problems.append(Problem(
            "data.factory", "a DPO factory cannot be combined with " + ", ".join(
                f"data.{k}" for k in others), got={"data.factory": r.data.factory},
            hint="use either the factory or one built-in preference source; to train on the "
            "factory, turn the built-in source off: " + " ".join(_OFF[k] for k in others)
            + " on the command line (or remove it from the recipe)"))
    elif len(others) > 1:
        problems.append(Problem(f"data.{others[1]}", " and ".join(f"data.{k}" for k in others)
                                + " are mutually exclusive", hint="keep one preference source"))
    for k in ("path", "name"):
        if _set(getattr(r.data, k)):
            problems.append(Problem(f"data.{k}", "DPO does not read prompt datasets",
                                    got=getattr(r.data, k),
                                    hint="use data.jsonl_path, data.tar_path, "
                                    "data.synthetic_pairs or data.factory"))
    if _set(r.data.validation.path):
        problems.append(Problem("data.validation.path", "DPO reads held-out pairs from "
                                "data.validation.jsonl_path or data.validation.factory",
                                got=r.data.validation.path,
                                hint="use data.validation.jsonl_path for a file of pairs"))
    return problems


def check_algorithm_keys(r: Recipe) -> list[Problem]:
    """Keys that belong to another algorithm are errors, not silently ignored: every key some
    algorithm owns (``AlgoSpec.owned_keys``) and this recipe's algorithm does not read."""
    spec, problems = spec_of(r), []
    owned = dict.fromkeys(k for s in ALGORITHMS.values() for k in s.owned_keys)
    for key in owned:
        value = _lookup(r, key)
        if spec.reads(key) or not _set(value) or value == _default(r, key):
            continue
        problems.append(Problem(key, f"only used by {titles(lambda s, k=key: s.reads(k))}, but "
                                f"algo.kind is {r.algo.kind!r}", got=value,
                                hint=OWNED_KEY_HINTS.get(key, "remove the key")))
    return problems


def check_validation_source(r: Recipe) -> list[Problem]:
    v = r.data.validation
    chosen = [k for k in ("factory", "path", "jsonl_path") if _set(getattr(v, k))]
    if len(chosen) > 1:
        return [Problem(f"data.validation.{chosen[1]}", " and ".join(
            f"data.validation.{k}" for k in chosen) + " are mutually exclusive",
            hint="keep one held-out source")]
    return []


def batch_key(r: Recipe) -> tuple[str, int]:
    """The recipe key that sets the global batch of items per step, and its value."""
    spec = spec_of(r)
    return spec.batch_key, spec.items_per_step(r.algo)


def check_launch(r: Recipe) -> list[Problem]:
    """The layouts this version runs, and a global batch every rank gets an equal share of."""
    launch = r.launch
    if launch.num_processes < 1:
        return [Problem("launch.num_processes", "must be at least 1", got=launch.num_processes)]
    if launch.backend == "local" and launch.num_processes != 1:
        return [Problem("launch.num_processes", "the local backend runs one process",
                        got=launch.num_processes,
                        hint="set launch.backend = 'torchrun' for several processes")]
    problems = check_ray_keys(r)
    if not launch.collective_timeout_s > 0:
        problems.append(Problem("launch.collective_timeout_s",
                                "must be a positive number of seconds",
                                got=launch.collective_timeout_s))
    key, items = batch_key(r)
    if items % launch.num_processes:
        problems.append(Problem(
            key, f"{items} items per step do not split evenly over launch.num_processes = "
            f"{launch.num_processes} ranks", got=items,
            hint=f"use a multiple of {launch.num_processes}, or another launch.num_processes"))
    return problems

_RAY_KEYS = ("ray_address", "ray_runtime_env", "placement", "rollout_actors", "cpus_per_rank",
             "gpus_per_rank", "cpus_per_role_actor", "gpus_per_role_actor")


def check_ray_keys(r: Recipe) -> list[Problem]:
    """The Ray keys: only with the ray backend, resources >= 0, a separate rollout only where
    something generates."""
    launch = r.launch
    if launch.backend != "ray":
        return [Problem(f"launch.{k}", "is a key of the ray backend",
                        got=getattr(launch, k), hint="set launch.backend = 'ray', or leave it out")
                for k in _RAY_KEYS if getattr(launch, k) != default_of(LaunchConfig, k)]
    p: list[Problem] = []
    for k in ("cpus_per_rank", "gpus_per_rank", "cpus_per_role_actor",
              "gpus_per_role_actor"):
        value = getattr(launch, k)
        p += _range(f"launch.{k}", value, value >= 0, ">= 0")
    if launch.cpus_per_rank == 0 and launch.gpus_per_rank == 0:
        p.append(Problem("launch.cpus_per_rank", "a rank must reserve some CPU or GPU", got=0.0,
                         hint="set launch.cpus_per_rank > 0 (it may be fractional)"))
    if launch.placement == "separate":
        if not 1 <= launch.rollout_actors <= launch.num_processes:
            p.append(Problem("launch.rollout_actors", "must be between 1 and "
                             f"launch.num_processes ({launch.num_processes})",
                             got=launch.rollout_actors))
        if launch.cpus_per_role_actor == 0 and launch.gpus_per_role_actor == 0:
            p.append(Problem("launch.cpus_per_role_actor", "a rollout actor must reserve some "
                             "CPU or GPU", got=0.0, hint="set it > 0 (it may be fractional)"))
    elif launch.rollout_actors != 1:
        p.append(Problem("launch.rollout_actors", "only placement = 'separate' has rollout "
                         "actors", got=launch.rollout_actors,
                         hint="set launch.placement = 'separate', or leave it out"))
    return p


def check_env(r: Recipe) -> list[Problem]:
    """``[env]``: multi-turn episodes where a rollout loop plays them (the algorithms that
    sample online; OPD's mode is OPD's own check), with bounds that leave room for a turn."""
    e = r.env
    if not env_enabled(r):
        return []
    p: list[Problem] = []
    spec = spec_of(r)
    if not spec.samples_online:
        key = "env.factory" if e.factory else "env.agent" if e.agent else "env.tools"
        p.append(Problem(key, f"{spec.title} trains on given pairs and plays no episodes",
                         got=e.factory or e.agent or e.tools, hint="remove the [env] table, or use "
                         + titles(lambda s: s.samples_online)))
    p += _range("env.max_turns", e.max_turns, 1 <= e.max_turns <= 1024, "in [1, 1024]")
    p += _range("env.max_total_tokens", e.max_total_tokens,
                2 <= e.max_total_tokens <= MAX_PER_STEP, f"in [2, {MAX_PER_STEP:,}]")
    p += _range("env.tool_timeout_s", e.tool_timeout_s, e.tool_timeout_s >= 0, ">= 0 (0: no "
                "limit)")
    p += _range("env.step_timeout_s", e.step_timeout_s, e.step_timeout_s >= 0, ">= 0 (0: no "
                "limit)")
    if e.on_rewrite == "split" and not e.agent:
        p.append(Problem("env.on_rewrite", "splits an agent's episode where its call rewrites "
                         "the history; the environments of env.factory and env.tools never do",
                         got=e.on_rewrite, hint="remove env.on_rewrite, or set env.agent"))
    if e.agent and (e.factory or e.tools):
        p.append(Problem("env.agent", "an agent plays the episode itself (its own tools, over "
                         "the OpenAI API): it takes no env.factory or env.tools", got=e.agent,
                         hint="remove env.factory and env.tools, or env.agent"))
    p += _range("env.concurrency", e.concurrency, 1 <= e.concurrency <= 4096, "in [1, 4096]")
    p += _range("env.episode_timeout_s", e.episode_timeout_s, e.episode_timeout_s > 0, "> 0")
    if r.rollout.max_model_len and e.max_total_tokens > r.rollout.max_model_len:
        p.append(Problem("env.max_total_tokens", f"is more than rollout.max_model_len "
                         f"({r.rollout.max_model_len}), which holds a whole episode",
                         got=e.max_total_tokens, hint="lower it, or raise rollout.max_model_len"))
    return p


def check_dotted_paths(r: Recipe) -> list[Problem]:
    from runner.extensions import is_dotted_path

    paths = {
        "data.factory": r.data.factory,
        "data.items_fn": r.data.items_fn,
        "data.validation.factory": r.data.validation.factory,
        "data_packer.factory": r.data_packer.factory,
        "data_packer.teacher_model_factory": r.data_packer.teacher_model_factory,
        "env.factory": r.env.factory,
        "env.agent": r.env.agent,
        **{f"env.tools[{i}]": t for i, t in enumerate(r.env.tools)},
    }
    problems = [Problem(k, "not a dotted path", got=v, hint=_DOTTED_HINT)
                for k, v in paths.items() if v and not is_dotted_path(v)]
    for i, fn in enumerate(r.reward.functions):
        if fn not in BUILTIN_REWARDS and not is_dotted_path(fn) and not fn.startswith("model:"):
            problems.append(Problem(f"reward.functions[{i}]", "neither a built-in reward, a "
                                    "reward model (model:PATH) nor a dotted path", got=fn,
                                    hint="built-in rewards: " + ", ".join(BUILTIN_REWARDS)))
    return problems


def trackers_of(logging: LoggingConfig) -> tuple[str, ...]:
    """The trackers a run reports to besides metrics.jsonl (always written), in the order of
    logging.report_to, each once; the deprecated ``logging.tensorboard = true`` adds
    tensorboard."""
    names = [n for n in logging.report_to if n != "jsonl"]
    if logging.tensorboard:
        names.append("tensorboard")
    return tuple(dict.fromkeys(names))


# Characters W&B refuses in a project name.
_WANDB_PROJECT_FORBIDDEN = "/\\#?%:"


def check_logging(r: Recipe) -> list[Problem]:
    """A tracker run needs a project name (W&B's project, MLflow's experiment)."""
    names, project = trackers_of(r.logging), r.logging.project
    if not {"wandb", "mlflow"} & set(names):
        return []
    if not project.strip():
        return [Problem("logging.project", "must name the W&B project / MLflow experiment",
                        got=project, hint='e.g. project = "posttrain-runner"')]
    bad = sorted({c for c in project if c in _WANDB_PROJECT_FORBIDDEN})
    if "wandb" in names and bad:
        return [Problem("logging.project", "W&B project names cannot hold "
                        + " ".join(repr(c) for c in bad), got=project,
                        hint="use letters, digits, '-', '_' and '.'")]
    return []


def check_ranges(r: Recipe) -> list[Problem]:
    d: DataConfig = r.data
    p: list[Problem] = []
    p += _range("run.max_steps", r.run.max_steps, r.run.max_steps >= 1, ">= 1")
    p += _range("train.lr", r.train.lr, r.train.lr > 0, "> 0")
    p += _range("train.weight_decay", r.train.weight_decay, r.train.weight_decay >= 0, ">= 0")
    p += _range("train.warmup_steps", r.train.warmup_steps, r.train.warmup_steps >= 0, ">= 0")
    p += _range("train.grad_accum_steps", r.train.grad_accum_steps,
                r.train.grad_accum_steps >= 1, ">= 1")
    p += _range("train.max_tokens_per_microbatch", r.train.max_tokens_per_microbatch,
                r.train.max_tokens_per_microbatch >= 0, ">= 0 (0: off)")
    p += _range("train.logprob_max_tokens_per_microbatch",
                r.train.logprob_max_tokens_per_microbatch,
                r.train.logprob_max_tokens_per_microbatch >= 0, ">= 0 (0: off)")
    p += _range("train.max_grad_norm", r.train.max_grad_norm, r.train.max_grad_norm >= 0, ">= 0")
    p += _range("train.eval_every", r.train.eval_every, r.train.eval_every >= 0, ">= 0")
    for name in ("adam_beta1", "adam_beta2"):
        value = getattr(r.train, name)
        p += _range(f"train.{name}", value, 0 <= value < 1, "in [0, 1)")
    lora = r.model.lora
    p += _range("model.lora.rank", lora.rank, lora.rank >= 0, ">= 0 (0: no adapters)")
    p += _range("model.lora.alpha", lora.alpha, lora.alpha > 0, "> 0")
    p += _range("model.lora.dropout", lora.dropout, 0 <= lora.dropout < 1, "in [0, 1)")
    p += _range("rollout.max_new_tokens", r.rollout.max_new_tokens,
                r.rollout.max_new_tokens >= 1, ">= 1")
    p += _range("rollout.temperature", r.rollout.temperature, r.rollout.temperature > 0, "> 0")
    p += _range("rollout.top_p", r.rollout.top_p, 0 < r.rollout.top_p <= 1, "in (0, 1]")
    p += _range("rollout.top_k", r.rollout.top_k, r.rollout.top_k >= 0, ">= 0")
    p += _range("rollout.batch_size", r.rollout.batch_size, r.rollout.batch_size >= 1, ">= 1")
    longest = max(r.rollout.max_new_tokens, r.eval.max_new_tokens)
    p += _range("rollout.max_model_len", r.rollout.max_model_len,
                r.rollout.max_model_len == 0 or r.rollout.max_model_len > longest,
                f"0 (derived) or more than the most new tokens of a completion ({longest})")
    p += _range("rollout.gpu_memory_utilization", r.rollout.gpu_memory_utilization,
                0 < r.rollout.gpu_memory_utilization <= 1, "in (0, 1]")
    p += _range("checkpoint.every_steps", r.checkpoint.every_steps,
                r.checkpoint.every_steps >= 1, ">= 1")
    p += _range("checkpoint.keep_last", r.checkpoint.keep_last, r.checkpoint.keep_last >= 1, ">= 1")
    p += _range("logging.every_steps", r.logging.every_steps, r.logging.every_steps >= 1, ">= 1")
    p += _range("reward.timeout_s", r.reward.timeout_s, r.reward.timeout_s >= 0,
                ">= 0 (0: no limit)")
    p += _range("reward.workers", r.reward.workers, 0 <= r.reward.workers <= 256,
                "in [0, 256] (0: one per core)")
    p += _range("reward.sample_timeout_s", r.reward.sample_timeout_s,
                0 < r.reward.sample_timeout_s <= 86400, "in (0, 86400]")
    p += _range("reward.memory_mb", r.reward.memory_mb, 64 <= r.reward.memory_mb <= 1 << 20,
                "in [64, 1048576]")
    p += _eval_ranges(r)
    p += _range("data.count", d.count, d.count >= 1, ">= 1")
    p += _range("data.synthetic_pairs", d.synthetic_pairs, d.synthetic_pairs >= 0, ">= 0")
    p += _range("data.validation.size", d.validation.size, d.validation.size >= 1, ">= 1")
    if d.min_operand > d.max_operand:
        p.append(Problem("data.max_operand", f"must be >= data.min_operand ({d.min_operand})",
                         got=d.max_operand))
    for i, op in enumerate(d.operators):
        if op not in ("+", "-", "*"):
            p.append(Problem(f"data.operators[{i}]", "unknown operator", got=op,
                             hint="choose from '+', '-', '*'"))
    if not d.operators:
        p.append(Problem("data.operators", "must name at least one operator", got=[]))
    if r.reward.weights and len(r.reward.weights) != len(r.reward.functions):
        p.append(Problem("reward.weights", f"needs one weight per function "
                         f"({len(r.reward.functions)})", got=r.reward.weights))
    return p + spec_of(r).checks(r)


def _eval_ranges(r: Recipe) -> list[Problem]:
    e = r.eval
    p = _range("eval.max_new_tokens", e.max_new_tokens, e.max_new_tokens >= 0,
               ">= 0 (0: rollout.max_new_tokens)")
    p += _range("eval.num_samples", e.num_samples, e.num_samples >= 1, ">= 1")
    p += _range("eval.temperature", e.temperature, e.temperature >= 0, ">= 0 (0: greedy)")
    if e.num_samples > 1 and e.temperature == 0:
        p.append(Problem("eval.num_samples", "greedy evaluation (eval.temperature = 0) gives the "
                         "same completion every time", got=e.num_samples,
                         hint="set eval.temperature > 0, or eval.num_samples = 1"))
    for i, k in enumerate(e.pass_at):
        p += _range(f"eval.pass_at[{i}]", k, 1 <= k <= e.num_samples,
                    f"in 1..eval.num_samples ({e.num_samples})")
    if e.pass_reward and e.pass_reward not in r.reward.functions:
        p.append(Problem("eval.pass_reward", "is not one of reward.functions", got=e.pass_reward,
                         hint=f"choose from {r.reward.functions}"))
    return p


def check_reward_shaping(r: Recipe) -> list[Problem]:
    """``reward.overlong_buffer_len`` shapes the rewards of the algorithms that train on their
    own samples' rewards (their spec checks its range); elsewhere it would be ignored."""
    spec, n = spec_of(r), r.reward.overlong_buffer_len
    if not n or (spec.trains_on_rewards and spec.samples_online):
        return []
    return [Problem("reward.overlong_buffer_len", "only "
                    + titles(lambda s: s.trains_on_rewards and s.samples_online)
                    + f" train on shaped rewards, but algo.kind is {r.algo.kind!r}", got=n,
                    hint="remove the key")]


def check_sharding(r: Recipe) -> list[Problem]:
    """``train.sharding = "fsdp"`` where this version shards correctly: the policy of GRPO,
    DPO, OPD or PPO (with PPO's critic; full or LoRA), on local, torchrun or Ray ranks, in fp32 /
    bf16 / the model's own dtype."""
    if r.train.sharding != "fsdp":
        return []
    hint = "set train.sharding = 'none' (each rank a full copy)"
    problems = []
    if r.train.precision == "fp16":
        problems.append(Problem("train.sharding", "fsdp has no fp16 loss scaling; use "
                                "train.precision 'bf16' or 'no'", got="fsdp", hint=hint))
    if r.train.compile:
        problems.append(Problem("train.compile", "sharded models (train.sharding = 'fsdp') "
                                "run eager: compiling them is not supported", got=True,
                                hint="set train.compile = false (or train.sharding = 'none')"))
    return problems


def check_token_budget(r: Recipe) -> list[Problem]:
    """``train.max_tokens_per_microbatch`` replaces ``train.grad_accum_steps``' split;
    ``train.logprob_max_tokens_per_microbatch`` packs the scoring passes of the kinds that run
    them (``AlgoSpec.scoring_passes``)."""
    p: list[Problem] = []
    if r.train.logprob_max_tokens_per_microbatch > 0 and not spec_of(r).scoring_passes:
        p.append(Problem("train.logprob_max_tokens_per_microbatch",
                         f"algo.kind = {r.algo.kind!r} runs no scoring pass",
                         got=r.train.logprob_max_tokens_per_microbatch,
                         hint="remove the key (" + titles(lambda s: s.scoring_passes)
                         + " run scoring passes); train.max_tokens_per_microbatch packs the "
                         "updates"))
    if r.train.max_tokens_per_microbatch > 0 and r.train.grad_accum_steps > 1:
        p.append(Problem("train.max_tokens_per_microbatch", "train.max_tokens_per_microbatch "
                         "and train.grad_accum_steps > 1 are mutually exclusive",
                         got=r.train.max_tokens_per_microbatch,
                         hint="set train.grad_accum_steps = 1 (the budget decides the "
                         "micro-batches), or remove train.max_tokens_per_microbatch"))
    return p


RULES: tuple[Callable[[Recipe], list[Problem]], ...] = (
    check_prompt_source,
    check_pair_source,
    check_algorithm_keys,
    check_validation_source,
    check_launch,
    check_sharding,
    check_dotted_paths,
    check_env,
    check_ranges,
    check_reward_shaping,
    check_token_budget,
    check_logging,
)


def check_recipe(recipe: Recipe) -> list[Problem]:
    """Every cross-field problem of ``recipe``, in a stable order."""
    return [problem for rule in RULES for problem in rule(recipe)]


# --- bounds of integer keys (documented in README.md, Limits) ------------------------------

MAX_ITEMS = 1_000_000  # data.count, data.validation.size, data.synthetic_pairs
MAX_ARITHMETIC_POOL = 1_000_000  # (max_operand - min_operand + 1)**2 x len(operators)
MAX_STEPS = 1_000_000_000  # run.max_steps and every "every N steps" key
MAX_PER_STEP = 1_048_576  # per-step sizes: prompts, samples, pairs, epochs, minibatches, tokens
MAX_TAR_MEMBER_BYTES = 1 << 34  # data.tar_member_max_bytes (16 GiB)
MAX_TAR_BYTES = 1 << 40  # data.tar_max_bytes (1 TiB)
MAX_TIMEOUT_S = 604_800  # every *_timeout_s key: a week (beyond it, thread joins overflow)

_ITEM_KEYS = ("data.count", "data.validation.size", "data.synthetic_pairs")
_STEP_KEYS = ("run.max_steps", "train.warmup_steps", "train.eval_every", "checkpoint.every_steps",
              "checkpoint.keep_last", "logging.every_steps", "logging.sample_every")
_PER_STEP_KEYS = ("train.grad_accum_steps", "train.max_tokens_per_microbatch",
                  "train.logprob_max_tokens_per_microbatch",
                  "rollout.max_new_tokens", "rollout.max_model_len", "rollout.top_k",
                  "rollout.batch_size", "algo.prompts_per_step", "algo.group_size",
                  "algo.samples_per_prompt", "algo.pairs_per_step", "algo.ppo_epochs",
                  "algo.minibatches")
_TIMEOUT_KEYS = ("reward.timeout_s", "env.tool_timeout_s", "env.step_timeout_s",
                 "launch.collective_timeout_s")


def _default(r: Recipe, dotted: str) -> object:
    """The schema's default of a key (a key whose default is a value, such as
    data.synthetic_rejected, is set only when it differs from it)."""
    table, _, name = dotted.rpartition(".")
    default = attrs.fields_dict(type(_lookup(r, table)))[name].default
    return None if isinstance(default, attrs.Factory) else default  # type: ignore[arg-type]


def _lookup(r: Recipe, dotted: str) -> object:
    value: object = r
    for part in dotted.split("."):
        value = getattr(value, part, None)
    return value


def check_limits(r: Recipe) -> list[Problem]:
    """Integer keys and timeouts bounded to what a run can use, so an absurd value fails here
    and not after minutes of building data (or when seeding, or waiting on a thread). The
    generic rules (finite floats, 64-bit integers) are the converter's."""
    p: list[Problem] = []
    for keys, limit in ((_ITEM_KEYS, MAX_ITEMS), (_STEP_KEYS, MAX_STEPS),
                        (_PER_STEP_KEYS, MAX_PER_STEP)):
        for k in keys:
            value = _lookup(r, k)
            if isinstance(value, int) and value > limit:
                p.append(Problem(k, f"must be at most {limit:,}", got=value))
    for k in _TIMEOUT_KEYS:
        value = _lookup(r, k)
        if isinstance(value, int | float) and value > MAX_TIMEOUT_S:
            p.append(Problem(k, f"must be at most {MAX_TIMEOUT_S:,} seconds (a week)", got=value))
    d = r.data
    span = d.max_operand - d.min_operand + 1
    if span > 0 and span * span * max(1, len(d.operators)) > MAX_ARITHMETIC_POOL:
        p.append(Problem("data.max_operand", "the built-in arithmetic pool (max_operand - "
                         f"min_operand + 1)**2 x len(operators) must be at most "
                         f"{MAX_ARITHMETIC_POOL:,}", got=d.max_operand,
                         hint="narrow the operand range"))
    size = d.tar_member_max_bytes
    if not 1 <= size <= MAX_TAR_MEMBER_BYTES:
        p.append(Problem("data.tar_member_max_bytes", f"must be in [1, {MAX_TAR_MEMBER_BYTES:,}]",
                         got=size))
    if not 1 <= d.tar_max_bytes <= MAX_TAR_BYTES:
        p.append(Problem("data.tar_max_bytes", f"must be in [1, {MAX_TAR_BYTES:,}]",
                         got=d.tar_max_bytes))
    return p
