"""PPO with a custom source: the PPO-only columns (image, id, allowlisted metadata) reach the
trajectory the reward sees, and each prompt is tokenised once, on the rollout side (one step,
called directly on a run assembled in this process: ``tests/tiny_run.py``)."""

from __future__ import annotations

import importlib

from runner.packers.decoder_only import DecoderOnlyLLMDataPacker
from runner.rewards.builtin import arithmetic_exact
from runner.train.loops import ppo
from tests.tiny_run import tiny_run

SEEN: list = []  # the items the reward was called with


class PPORows:
    """Arithmetic rows with PPO-only columns and one column that is not allowlisted."""

    def __init__(self, count: int) -> None:
        self.count = count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> dict:
        return {"q": f"What is {i} + {i}?", "a": str(2 * i), "img": f"img-{i}.png", "uid": f"u{i}",
                "lang": "en" if i % 2 else "fr", "secret": "never in the trajectory"}

    def cursor_fingerprint(self) -> str:
        return f"ppo-rows-{self.count}"


def ppo_rows(count: int = 16) -> PPORows:
    return PPORows(count)


def recording_reward(completions, items):
    SEEN.extend(items)
    return arithmetic_exact(completions, items)


RECIPE = """
[run]
max_steps = 2

[model]
path = "builtin:tiny-arith"

[data]
factory = "tests.test_ppo_trajectory.ppo_rows"
factory_kwargs = { count = 16 }
prompt_column = "q"
response_column = "a"
image_column = "img"
id_column = "uid"
metadata_columns = ["lang"]

[data.validation]
enabled = false

[algo]
kind = "ppo"
prompts_per_step = 4
samples_per_prompt = 2

[rollout]
max_new_tokens = 4

[reward]
functions = ["tests.test_ppo_trajectory.recording_reward"]
"""


def test_ppo_columns_reach_the_trajectory_and_prompts_are_tokenised_once(tmp_path, monkeypatch):
    encoded: list[int] = []
    original = DecoderOnlyLLMDataPacker.encode_rollout_input

    def counting(self, rollout_input):
        encoded.append(1)
        return original(self, rollout_input)

    monkeypatch.setattr(DecoderOnlyLLMDataPacker, "encode_rollout_input", counting)
    # The recipe names this module by its dotted path; pytest may have imported it under
    # another name, so read the list of the module the runner loads.
    seen = importlib.import_module("tests.test_ppo_trajectory").SEEN
    seen.clear()
    recipe = tmp_path / "ppo.toml"
    recipe.write_text(RECIPE)
    with tiny_run(recipe, tmp_path) as run:
        rewards, critic = run.roles.rewards, run.roles.critic
        metrics = ppo.one_step(run, run.svc.recipe.algo, rewards, critic, 1)
    # 4 prompts x 2 samples, each completion with its own item.
    assert len(seen) == 8
    ids = [item.id for item in seen]
    assert ids == [i for i in ids[::2] for _ in range(2)]  # both samples of a prompt share it
    for item in seen:
        i = int(item.id[1:])
        assert item.prompt == f"What is {i} + {i}?" and item.reference == str(2 * i)
        assert item.images == (f"img-{i}.png",)
        assert item.metadata == {"lang": "en" if i % 2 else "fr"}  # "secret" is not allowlisted
    # The rollout side tokenises each prompt once; policy, reference and critic reuse the ids
    # through the whole step (scoring, the update and the weights' sync).
    assert len(encoded) == 4
    assert "value_loss" in metrics
