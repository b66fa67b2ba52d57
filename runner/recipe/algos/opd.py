"""OPD's spec: the student's samples scored token by token by a teacher (reverse KL)."""

from __future__ import annotations

from runner.errors import Problem
from runner.recipe.algos import sampled
from runner.recipe.algos.spec import AlgoSpec, ModelRef, Shape
from runner.recipe.rules import env_enabled, in_range
from runner.recipe.schema import OPDConfig, Recipe


def shape(a: OPDConfig) -> Shape:
    return Shape(a.prompts_per_step, a.prompts_per_step * a.samples_per_prompt, a.ppo_epochs)


def roles(r: Recipe) -> frozenset[str]:
    """The recipe's rewards score its samples for the log."""
    return frozenset({"rollout", "reward", "teacher"})


def sharded(a: OPDConfig) -> tuple[str, ...]:
    """A teacher that shares the student's tokenizer is sharded like the reference; a
    cross-tokenizer teacher scores each item through its own packer and stays whole."""
    same = ("teacher",) if a.mode == "same_tokenizer" else ()
    return ("policy", "critic", "reference", *same)


def models(a: OPDConfig) -> tuple[ModelRef, ...]:
    return (ModelRef("algo.teacher_path", a.teacher_path, "teacher",
                     same_vocab=a.mode == "same_tokenizer", note=a.mode),)


def checks(r: Recipe) -> list[Problem]:
    a = r.algo
    p = sampled.per_prompt_ranges(r)
    p += in_range("algo.clip_eps", a.clip_eps, 0 < a.clip_eps < 1, "in (0, 1)")
    p += in_range("algo.kl_coef", a.kl_coef, a.kl_coef > 0, "> 0")
    if not a.teacher_path:
        p.append(Problem("algo.teacher_path", "OPD needs a teacher model", got="",
                         hint="set algo.teacher_path to a model folder or builtin:NAME"))
    if a.full_kl and a.mode != "same_tokenizer":
        p.append(Problem("algo.full_kl", "needs mode 'same_tokenizer' (one shared vocabulary)",
                         got=True))
    factory = r.data_packer.teacher_model_factory
    if factory and a.mode != "cross_token_multimodal":
        p.append(Problem("data_packer.teacher_model_factory",
                         "only used by OPD in mode 'cross_token_multimodal'", got=factory,
                         hint="remove it, or set algo.mode = 'cross_token_multimodal'"))
    if env_enabled(r) and a.mode != "same_tokenizer":
        p.append(Problem("algo.mode", "[env] episodes need mode 'same_tokenizer' (the teacher "
                         "scores the episode's own tokens)", got=a.mode))
    return p + sampled.off_policy_ranges(r)


SPEC = AlgoSpec(
    title="OPD", config=OPDConfig, stream="prompts", batch_key="algo.prompts_per_step",
    shape=shape, roles=roles, checks=checks, loop="runner.train.loops.opd", ahead=sampled.ahead,
    owned_keys=(*sampled.MEDIA_KEYS, "data_packer.teacher_model_factory"),
    sharded=sharded, models=models, scoring_passes=True, balances_ranks=True,
)
