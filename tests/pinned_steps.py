"""The first steps of each shipped tiny recipe, pinned: losses, rewards and gradient norms of
steps 1 and 2 are deterministic on CPU (one thread) and start from the shipped weights, so a
change of the math shows as a change of these numbers, on any CPU (up to its float kernels' last
bits: ``tests/test_pinned_steps.py``).

When the math changes on purpose, or the shipped models are rebuilt, regenerate the file and say
why in the commit: ``.venv/bin/python -m tests.pinned_steps --write`` (``--recipes NAME ...``
reruns only those and keeps the others' pinned numbers).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from tests.resume_helpers import deterministic_rows, run_cli

PINNED = Path(__file__).parent / "data" / "pinned_steps.json"
RECIPES = {
    "grpo-arith": ("algo.prompts_per_step=4", "algo.group_size=4", "rollout.max_new_tokens=4"),
    "ppo-arith": ("algo.prompts_per_step=4", "rollout.max_new_tokens=4"),
    "opd-arith": ("algo.prompts_per_step=4", "rollout.max_new_tokens=4"),
    "opd-cross-tokenizer": ("algo.prompts_per_step=2", "rollout.max_new_tokens=4"),
    "dpo-arith": ("algo.pairs_per_step=8",),
    "sft-arith": ("algo.examples_per_step=8",),
    "rm-arith": ("algo.pairs_per_step=8",),
}
COMMON = ("run.max_steps=2", "data.validation.enabled=false", "logging.sample_every=0")
KEYS = ("loss", "reward/mean", "grad_norm", "reverse_kl", "kl", "value_loss", "reward_margin")


def first_steps(name: str) -> list[dict[str, float]]:
    with tempfile.TemporaryDirectory() as out:
        done = run_cli(f"recipes/{name}.toml", Path(out), *COMMON, *RECIPES[name])
        if done.returncode != 0:
            raise RuntimeError(done.stdout + done.stderr)
        rows = deterministic_rows(Path(out))
    return [{k: r[k] for k in KEYS if k in r} for r in rows]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--recipes", nargs="+", choices=sorted(RECIPES), default=sorted(RECIPES))
    args = parser.parse_args()
    values = json.loads(PINNED.read_text()) if PINNED.exists() else {}
    values.update({name: first_steps(name) for name in args.recipes})
    text = json.dumps(values, indent=1, sort_keys=True) + "\n"
    if args.write:
        PINNED.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
