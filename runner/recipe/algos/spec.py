"""What the rest of the package may ask about an algorithm, answered in one place per kind.

Each kind of ``[algo]`` has one ``AlgoSpec`` (``runner.recipe.algos.ALGORITHMS``): the plan,
the recipe checks, the data layer, the preflight and the dry-run preview read these facts
instead of testing the algorithm's kind. A new kind is its config class in
``runner.recipe.schema``, its spec module here, its loss in ``runner.algorithms`` and its loop
in ``runner.train``, plus one row of ``ALGORITHMS``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import attrs

from runner.errors import Problem
from runner.recipe.schema import Recipe

# The roles every run builds; an algorithm adds its own (runner.recipe.plan.ROLE_ORDER).
BASE_ROLES = frozenset({"driver", "policy"})

# Keys of [data] / [data_packer] that only some algorithms read: a recipe that sets one its
# algorithm does not read is refused (runner.recipe.checks.check_algorithm_keys). The hint
# says what to do instead.
OWNED_KEY_HINTS = {
    "data.validation.jsonl_path": "use data.validation.path",
    "data_packer.teacher_model_factory": "remove it, or set algo.kind = 'opd' and algo.mode = "
                                         "'cross_token_multimodal'",
}


@attrs.frozen
class Shape:
    """One step's sizes, all ranks together: ``items`` drawn from the data, ``samples``
    sequences trained on, ``passes`` over them, each split into ``splits`` optimizer steps."""

    items: int
    samples: int
    passes: int = 1
    splits: int = 1


@attrs.frozen
class ModelRef:
    """A model folder an algorithm loads besides the policy: its recipe key, the path, its role
    in the plan, whether it must share the policy's vocabulary (checked before a run), and a
    note the dry run shows beside it."""

    key: str
    path: str
    role: str
    same_vocab: bool = False
    note: str = ""


def _no_models(algo: Any) -> tuple[ModelRef, ...]:
    return ()


def _none_ahead(algo: Any) -> int:
    return 0


def _one_batch(algo: Any) -> int:
    return 1


def _trained_and_reference(algo: Any) -> tuple[str, ...]:
    return ("policy", "critic", "reference")


@attrs.frozen
class AlgoSpec:
    """The facts of one algorithm kind.

    - ``title``: how messages name it ("GRPO").
    - ``config``: its ``[algo]`` config class (``runner.recipe.schema``).
    - ``stream``: the data it trains on: ``"prompts"`` (sampled by the engine), ``"pairs"``
      (preference pairs, read as given) or ``"conversations"`` (chat conversations, read as
      given from the same sources as prompts).
    - ``batch_key``: the ``[algo]`` key that sets the items drawn per step (all ranks).
    - ``shape(algo)``: a step's sizes (``Shape``).
    - ``roles(recipe)``: the roles it builds besides the driver and the policy.
    - ``checks(recipe)``: its own ranges and cross-key rules, as problems.
    - ``owned_keys``: the ``[data]`` / ``[data_packer]`` keys only some algorithms read that
      this one reads; set by another algorithm's recipe they are refused.
    - ``samples_online``: it trains on samples its engine draws each step (and so can play
      ``[env]`` episodes and sample ahead); otherwise its engine, if any, only generates for
      held-out evaluation.
    - ``trains_on_rewards``: its loss uses the reward functions' scores (otherwise they are
      logged); their call signature is checked before the run.
    - ``needs_fingerprint``: a custom prompt source must have ``cursor_fingerprint()``.
    - ``sharded(algo)``: the roles ``train.sharding = "fsdp"`` shards, of those it may have.
    - ``models(algo)``: model folders it loads besides the policy (``ModelRef``).
    - ``ahead(algo)``: the steps whose batches a producer samples ahead (0: synchronous).
    - ``batches(algo)``: the most batches of its items one step may draw (GRPO's dynamic
      sampling draws more when it drops groups; 1 otherwise).
    - ``head``: what the trained model is: ``"lm"`` a language model (its logits over the
      vocabulary), ``"score"`` a scalar score head on the same architecture (transformers'
      ``*ForSequenceClassification`` with ``num_labels = 1``: a reward model), which the
      assembly loads, checkpoints and exports instead.
    - ``scoring_passes``: it runs forwards without gradient before its updates (behaviour,
      reference or teacher logprobs, critic values), which
      ``train.logprob_max_tokens_per_microbatch`` packs by tokens
      (``runner.train.loops.batches.scored_by_tokens``).
    - ``balances_ranks``: its update passes split each optimizer step's rows between the ranks
      by tokens under ``train.balance_ranks`` (``runner.train.loops.balance``).
    - ``loop``: the module of its training loop (its ``run(RunContext)``), imported when a run
      starts, so that the recipe layer stays free of torch.
    """

    title: str
    config: type
    stream: Literal["prompts", "pairs", "conversations"]
    batch_key: str
    shape: Callable[[Any], Shape]
    roles: Callable[[Recipe], frozenset[str]]
    checks: Callable[[Recipe], list[Problem]]
    loop: str
    owned_keys: tuple[str, ...] = ()
    samples_online: bool = True
    trains_on_rewards: bool = False
    needs_fingerprint: bool = False
    sharded: Callable[[Any], tuple[str, ...]] = _trained_and_reference
    models: Callable[[Any], tuple[ModelRef, ...]] = _no_models
    ahead: Callable[[Any], int] = _none_ahead
    batches: Callable[[Any], int] = _one_batch
    head: Literal["lm", "score"] = "lm"
    scoring_passes: bool = False
    balances_ranks: bool = False

    @property
    def kind(self) -> str:
        """The ``kind`` tag of its config (``algo.kind``)."""
        return attrs.fields(self.config).kind.default

    def items_per_step(self, algo: Any) -> int:
        return getattr(algo, self.batch_key.removeprefix("algo."))

    def reads(self, key: str) -> bool:
        """Whether this algorithm reads ``key``, one of some algorithm's ``owned_keys``."""
        return key in self.owned_keys
