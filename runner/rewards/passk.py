"""Several samples per held-out prompt: which completions pass, pass@k and majority voting.

A completion *passes* when the value of the recipe's pass function (``eval.pass_reward``: a
reward function of ``reward.functions``) is at least ``eval.pass_threshold``. Over ``n``
completions of one prompt with ``c`` passing, pass@k is the unbiased estimate of the chance that
at least one of ``k`` completions drawn without replacement passes (Chen et al. 2021):
``1 - C(n - c, k) / C(n, k)``. Majority voting (maj@n) takes the answer most of the prompt's
completions give (ties: the one given first) and counts the prompt as solved when that answer
passes; it needs the pass function's notion of an answer, which the built-in exact-match rewards
have (``ANSWER_OF``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

from runner.recipe.schema import EvalConfig, RewardConfig
from runner.rewards.builtin import final_answer, final_integer

# built-in exact-match reward -> the answer a completion gives, as that reward reads it (None:
# no answer). Two completions with the same answer get the same reward.
ANSWER_OF: dict[str, Callable[[str], object]] = {
    "arithmetic_exact": final_integer,
    "exact_match": lambda text: text.strip().lower(),
    "math_verify": lambda text: final_answer(text) or None,
}


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one prompt with ``c`` of ``n`` completions passing (``k <= n``),
    as a product that stays exact for large ``n``: ``1 - prod_{i=n-c+1}^{n} (1 - k / i)``."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@{k} needs 0 <= c <= n and 1 <= k <= n (n={n}, c={c})")
    if n - c < k:
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def pass_ks(cfg: EvalConfig) -> tuple[int, ...]:
    """The k of every pass@k reported: ``eval.pass_at``, or 1 and ``eval.num_samples``."""
    return tuple(sorted(set(cfg.pass_at or (1, cfg.num_samples))))


def pass_function(reward: RewardConfig, cfg: EvalConfig) -> str:
    """The reward function that decides whether a completion passes: ``eval.pass_reward``, or
    the recipe's only function, or its first built-in exact-match one ("" when none is)."""
    if cfg.pass_reward:
        return cfg.pass_reward
    if len(reward.functions) == 1:
        return reward.functions[0]
    return next((name for name in reward.functions if name in ANSWER_OF), "")


def majority_passes(completions: Sequence[str], passed: Sequence[bool],
                    answer_of: Callable[[str], object]) -> bool:
    """Whether the answer most ``completions`` give passes (no answer at all: it does not)."""
    answers = [answer_of(text) for text in completions]
    counts = Counter(a for a in answers if a is not None)
    if not counts:
        return False
    top = max(counts.values())
    first = next(i for i, a in enumerate(answers) if a is not None and counts[a] == top)
    return bool(passed[first])
