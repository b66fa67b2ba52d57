"""Reward models: the Bradley-Terry loss and its gradient by hand, the score head as transformers
computes it on a checkpoint and an exported folder, a short CLI run, an exact resume after a
SIGKILL and the recipe's refusals."""

from __future__ import annotations

import json
import math
import random
from types import SimpleNamespace

import pytest
import torch

from runner.algorithms.rm import rm_loss
from runner.errors import RecipeError
from runner.models import load_causal_lm, resolve_model_path
from runner.packers import build_packer
from runner.recipe import load_recipe
from runner.state.layout import MODEL_DIR
from runner.train.loops.dpo import pack_pairs
from runner.train.roles import Trainable
from tests.conftest import REPO
from tests.resume_helpers import assert_same_run, kill_at_random_points, rows
from tests.resume_helpers import run_cli as run_subprocess

RECIPE = "recipes/rm-arith.toml"
SMALL = ("algo.pairs_per_step=4", "data.validation.size=8", "train.eval_every=2",
         "logging.sample_every=0")
CHOSEN = [0.3, -1.2, 2.0, 0.5]
REJECTED = [0.1, 0.4, -0.7, 0.5]  # the last pair a tie


def by_hand(center: float, chosen: list[float] = CHOSEN, rejected: list[float] = REJECTED,
            given: list[float] | None = None) -> tuple[float, list[float], list[float]]:
    """The loss and its gradients in the scores, written out per pair (``given``: the pairs'
    margins, 0 without):
    loss = 1/B sum_b [log(1 + exp(-x_b)) + k (c_b + r_b)^2], x_b = c_b - r_b - m_b;
    d/dx log(1 + exp(-x)) = -sigma(-x), so dloss/dc_b = (-sigma(-x_b) + 2k (c_b + r_b)) / B
    and dloss/dr_b = (sigma(-x_b) + 2k (c_b + r_b)) / B."""
    B = len(chosen)
    loss, d_c, d_r = 0.0, [], []
    for c, r, m in zip(chosen, rejected, given or [0.0] * B, strict=True):
        x, s = c - r - m, c + r
        loss += (math.log1p(math.exp(-x)) + center * s * s) / B
        pull = 1 / (1 + math.exp(x))  # sigma(-x)
        d_c.append((-pull + 2 * center * s) / B)
        d_r.append((pull + 2 * center * s) / B)
    return loss, d_c, d_r


@pytest.mark.parametrize("center", [0.0, 0.25])
def test_bradley_terry_loss_and_gradient_by_hand(center):
    chosen = torch.tensor(CHOSEN, dtype=torch.float64, requires_grad=True)
    rejected = torch.tensor(REJECTED, dtype=torch.float64, requires_grad=True)
    loss, metrics = rm_loss(chosen, rejected, center)
    loss.backward()
    want, d_c, d_r = by_hand(center)
    assert abs(loss.item() - want) < 1e-12
    assert max(abs(a - b) for a, b in zip(chosen.grad.tolist(), d_c, strict=True)) < 1e-12
    assert max(abs(a - b) for a, b in zip(rejected.grad.tolist(), d_r, strict=True)) < 1e-12
    assert metrics["accuracy"].item() == (2 + 0.5) / 4  # two right, one wrong, one tie
    margins = [c - r for c, r in zip(CHOSEN, REJECTED, strict=True)]
    assert abs(metrics["margin"].item() - sum(margins) / 4) < 1e-12
    assert abs(metrics["bt_loss"].item() - by_hand(0.0)[0]) < 1e-12


def test_head_lr_trains_the_score_head_at_its_own_rate():
    """``algo.head_lr``: the score head (the parameters outside transformers' base model) is an
    optimizer group of its own at that rate, the body at ``train.lr``, and the optimizer holds
    the parameters in the model's order; AdamW's first step (bias-corrected, no weight decay)
    moves each weight by about its group's rate, so the head's largest move is ``head_lr`` and
    the body's ``train.lr``. Without it: one group, as for any other model."""
    from runner.train.roles.policy import head_parameter_names, make_optimizer

    recipe = load_recipe(REPO / RECIPE, ["train.lr=1e-4", "algo.head_lr=2e-2",
                                         "train.weight_decay=0.0"])
    torch.manual_seed(0)
    model = load_causal_lm("builtin:tiny-arith", head="score").train()
    assert head_parameter_names(model) == {"score.weight"}
    assert len(make_optimizer(model, recipe.train).param_groups) == 1
    optimizer = make_optimizer(model, recipe.train, head_lr=recipe.algo.head_lr)
    assert [g["lr"] for g in optimizer.param_groups] == [1e-4, 2e-2]
    assert [id(p) for g in optimizer.param_groups for p in g["params"]] == [
        id(p) for p in model.parameters()]
    packer = build_packer(resolve_model_path("builtin:tiny-arith"), "qwen2")
    pairs = [SimpleNamespace(prompt=f"What is {a} + 3?", chosen=str(a + 3), rejected=str(a + 4),
                             id=str(a)) for a in range(4)]
    cpu = SimpleNamespace(device=torch.device("cpu"), mixed_precision="no")
    scores = Trainable(model, optimizer, None, cpu).scores(
        packer.collate(pack_pairs(packer, pairs)))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    rm_loss(scores[:4], scores[4:])[0].backward()
    optimizer.step()
    moved = {n: (p.detach() - before[n]).abs().max().item() for n, p in model.named_parameters()}
    assert moved.pop("score.weight") == pytest.approx(2e-2, rel=1e-3)
    assert max(moved.values()) == pytest.approx(1e-4, rel=1e-2)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Two steps of the recipe from the CLI, and the run exported."""
    out = tmp_path_factory.mktemp("rm") / "run"
    done = run_subprocess(RECIPE, out, "run.max_steps=2", *SMALL)
    assert done.returncode == 0, done.stdout + done.stderr
    return out


def test_cli_run_logs_pair_accuracy_and_margin(trained):
    first, last = rows(trained)[0], rows(trained)[-1]
    assert first["step"] == 0 and 0 <= first["eval/pair_accuracy"] <= 1
    assert last["step"] == 2 and {"loss", "accuracy", "margin", "eval/pair_accuracy",
                                  "eval/loss", "eval/margin"} <= set(last)
    config = json.loads((trained / "checkpoints" / "step-000002" / MODEL_DIR
                         / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForSequenceClassification"]
    assert len(config["id2label"]) == 1 and config["pad_token_id"] == 0  # num_labels = 1


def test_the_body_starts_from_model_path_and_the_head_is_new(trained):
    """The score model's body is ``model.path``'s language model: after 2 AdamW steps each of
    its weights is within 2 x 2 x lr of the folder's (an Adam step moves a weight by about lr;
    a freshly initialised body would differ by its whole scale); the head is one row over the
    hidden size, which the language model does not have."""
    from safetensors.torch import load_file

    lr = load_recipe(REPO / RECIPE).train.lr
    start = load_causal_lm(resolve_model_path("builtin:tiny-arith"))
    body = {k: v for k, v in start.state_dict().items() if k.startswith("model.")}
    after = load_file(trained / "checkpoints" / "step-000002" / MODEL_DIR / "model.safetensors")
    assert body and set(body) <= set(after), set(body) - set(after)
    worst = max(float((after[k].double() - v.double()).abs().max()) for k, v in body.items())
    assert worst <= 4 * lr, worst
    scale = min(float(v.double().abs().max()) for k, v in body.items() if v.ndim == 2)
    assert scale > 100 * lr
    hidden = start.config.hidden_size
    assert after["score.weight"].shape == (1, hidden) and "score.weight" not in start.state_dict()


def training_scores(folder, inputs) -> torch.Tensor:
    """The loop's scores of ``inputs``: one padded batch through ``Trainable.scores``."""
    model = load_causal_lm(folder, head="score")
    cpu = SimpleNamespace(device=torch.device("cpu"), mixed_precision="no")
    packer = build_packer(resolve_model_path("builtin:tiny-arith"), "qwen2")
    with torch.no_grad():
        return Trainable(model, None, None, cpu).scores(packer.collate(inputs))


def transformers_scores(folder, inputs) -> list[float]:
    """Each sequence scored alone by transformers' own class, as a user loads the folder."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    with torch.no_grad():
        return [model(input_ids=torch.tensor([x.input_ids])).logits[0, 0].item() for x in inputs]


def test_checkpoint_and_export_score_as_transformers_does(trained, tmp_path, run_cli):
    """The score head's output in the loop (a padded batch) equals transformers' on the
    checkpoint folder and on the exported folder (each sequence alone), float32, 1e-5."""
    packer = build_packer(resolve_model_path("builtin:tiny-arith"), "qwen2")
    pairs = [SimpleNamespace(prompt=q, chosen=c, rejected=r, id=q)
             for q, c, r in (("3+4=", "7", "8"), ("12-5=", "7", "6"), ("20+19=", "39", "19+20=39"))]
    inputs = pack_pairs(packer, pairs)
    assert len({len(x.input_ids) for x in inputs}) > 1  # the batch is padded
    ckpt = trained / "checkpoints" / "step-000002" / MODEL_DIR
    ours = training_scores(ckpt, inputs).tolist()
    theirs = transformers_scores(ckpt, inputs)
    assert max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) < 1e-5
    rc, out, err = run_cli("export", str(trained), str(tmp_path / "exported"))
    assert rc == 0, out + err
    exported = transformers_scores(tmp_path / "exported", inputs)
    assert max(abs(a - b) for a, b in zip(ours, exported, strict=True)) < 1e-5


RESUME = ("algo.pairs_per_step=4", "data.validation.size=8", "train.eval_every=2",
          "checkpoint.every_steps=1", "checkpoint.keep_last=3", "logging.sample_every=0")


def test_sigkill_resume_is_bitwise(tmp_path):
    """A straight run of 4 steps; another SIGKILLed once after a checkpoint, resumed to 4: the
    same metrics, weights (score head included), optimizer state and cursor."""
    straight, resumed = tmp_path / "a", tmp_path / "b"
    done = run_subprocess(RECIPE, straight, "run.max_steps=4", *RESUME)
    assert done.returncode == 0, done.stdout + done.stderr
    where = kill_at_random_points(RECIPE, resumed, 4, RESUME, random.Random(3), kills=1)
    done = run_subprocess(RECIPE, resumed, "run.max_steps=4", *RESUME)
    assert where, "no kill happened"
    assert done.returncode == 0 and "resuming" in done.stdout, done.stdout + done.stderr
    try:
        assert_same_run(resumed, straight, 4, ("model/model.safetensors",
                                               "optimizer.safetensors"))
    except AssertionError as exc:
        raise AssertionError(f"after kills at {where}: {exc}") from exc


@pytest.mark.parametrize(("override", "key"), [
    ("algo.center_coef=-0.1", "algo.center_coef"),
    ("algo.head_lr=-0.1", "algo.head_lr"),
    ("algo.pairs_per_step=0", "algo.pairs_per_step"),
    ("model.lora.rank=8", "model.lora.rank"),
    ("train.sharding=fsdp", "train.sharding"),
    ("data.messages_column=messages", "data.messages_column"),
    ("algo.beta=0.1", "algo.beta"),
])
def test_nonsense_combinations_are_refused_in_one_line(override, key):
    with pytest.raises(RecipeError) as info:
        load_recipe(REPO / RECIPE, [override])
    assert len(info.value.problems) == 1, str(info.value)
    assert key in str(info.value) and "\n" not in str(info.value).strip()


def test_a_resume_that_changes_whether_the_head_has_its_own_rate_is_refused(trained, tmp_path):
    """The recipe's checkpoint holds the score head in an optimizer group of its own
    (``algo.head_lr``); resumed with ``algo.head_lr = 0`` it is refused before any model is
    built, naming the key, and the checkpoint is left as it was."""
    import shutil

    assert load_recipe(REPO / RECIPE, []).algo.head_lr > 0
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    done = run_subprocess(RECIPE, run, "run.max_steps=3", "algo.head_lr=0", *SMALL)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "algo.head_lr" in done.stdout + done.stderr
    assert not (run / "checkpoints" / "step-000003").exists()


def test_eval_of_a_reward_model_is_refused_in_one_line(trained, run_cli):
    rc, out, err = run_cli("eval", "--plain", RECIPE, f"run.output_dir={trained}",
                           "--checkpoint", "latest")
    assert rc != 0 and "algo.kind" in out + err and "eval/pair_accuracy" in out + err
    assert len((out + err).strip().splitlines()) == 1, out + err


# --- a reward model in use: reward.functions = ["model:PATH"], run folders as model paths -------


def test_a_run_folder_means_its_newest_complete_checkpoints_model(trained, tmp_path):
    from runner.models import read_model_type
    from runner.models.loading import run_folder_models

    model = trained / "checkpoints" / "step-000002" / MODEL_DIR
    assert resolve_model_path(str(trained)) == model
    assert read_model_type(str(trained)) == "qwen2"
    recipe = load_recipe(REPO / "recipes/grpo-arith.toml",
                         [f'reward.functions=["model:{trained}"]'])
    assert run_folder_models(recipe) == {"reward.functions[0]": str(model)}
    (tmp_path / "checkpoints" / "step-000001").mkdir(parents=True)  # never completed
    with pytest.raises(RecipeError, match="has no complete checkpoint"):
        resolve_model_path(str(tmp_path), key="model.path")
    adapters = tmp_path / "checkpoints" / "step-000003"
    (adapters / MODEL_DIR).mkdir(parents=True)
    (adapters / "COMPLETE").write_text("")
    with pytest.raises(RecipeError, match="LoRA adapters.*posttrain-run export"):
        resolve_model_path(str(tmp_path), key="model.path")


def test_a_reward_model_scores_as_its_training_loop_and_transformers_do(trained):
    """``model:RUN`` scores each completion behind its prompt exactly as the reward-model run
    scored its chosen answers (``Trainable.scores`` on a padded batch) and as transformers does
    on the checkpoint folder, one sequence at a time (float32, 1e-5); scores come per
    completion, in order, batched by ``BATCH``."""
    from runner.recipe.schema import RewardConfig
    from runner.rewards import build_rewards
    from runner.rewards.model import BATCH
    from runner.types import ObsBundle

    rewards = build_rewards(RewardConfig(functions=[f"model:{trained}", "arithmetic_exact"],
                                         weights=[1.0, 0.0]))
    questions = [(f"What is {a} + {b}?", str(a + b + (i % 3 == 0))) for i, (a, b) in
                 enumerate((a, b) for a in range(7) for b in range(6))]  # 42 > BATCH
    assert len(questions) > BATCH
    items = [ObsBundle(q, reference=str(eval(q[8:-1]))) for q, _ in questions]
    texts = [answer for _, answer in questions]
    total, values = rewards.score_each(texts, items)
    packer = build_packer(resolve_model_path("builtin:tiny-arith"), "qwen2")
    inputs = pack_pairs(packer, [SimpleNamespace(prompt=i.prompt, chosen=t, rejected=t, id="")
                                 for i, t in zip(items, texts, strict=True)])[:len(items)]
    ckpt = trained / "checkpoints" / "step-000002" / MODEL_DIR
    loop = training_scores(ckpt, inputs).tolist()
    theirs = transformers_scores(ckpt, inputs)
    ours = values[f"model:{trained}"]
    assert max(abs(a - b) for a, b in zip(ours, loop, strict=True)) < 1e-5
    assert max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) < 1e-5
    assert total == ours  # the rule reward's weight is 0
    assert values["arithmetic_exact"] == [float(i % 3 != 0) for i in range(len(items))]


@pytest.mark.parametrize(("path", "why"), [
    ("builtin:tiny-arith", "is not a reward model"),
    ("/nonexistent/rm", "model folder not found"),
    ("", "names no reward model"),
])
def test_a_bad_reward_model_is_named_before_anything_is_built(path, why):
    from runner.preflight import validate_models

    recipe = load_recipe(REPO / "recipes/grpo-arith.toml", [f'reward.functions=["model:{path}"]'])
    problems = validate_models(recipe)
    assert [p.key for p in problems] == ["reward.functions[0]"], problems
    assert why in problems[0].message and "\n" not in problems[0].render()


def test_grpo_trains_on_a_reward_model_named_by_its_run_folder(trained, tmp_path, run_cli):
    """GRPO whose reward is the reward model (a run folder), the rule reward logged at weight 0:
    the run's rewards are the model's scores, the dry run shows the model and its memory, and
    the resolved recipe records the checkpoint the run folder meant."""
    functions = f'reward.functions=["model:{trained}","arithmetic_exact"]'
    args = ("algo.prompts_per_step=2", "algo.group_size=2", "rollout.max_new_tokens=4",
            "run.max_steps=1", "data.validation.size=4", "train.eval_every=1",
            "logging.sample_every=0", functions, "reward.weights=[1.0,0.0]")
    rc, out, err = run_cli("recipes/grpo-arith.toml", "--dry-run", "--plain",
                           f"run.output_dir={tmp_path / 'plan'}", *args)
    assert rc == 0, out + err
    assert "reward model (reward.functions[0])" in out and "reward model" in out.split(
        "Memory")[1]
    done = run_subprocess("recipes/grpo-arith.toml", tmp_path / "run", *args)
    assert done.returncode == 0, done.stdout + done.stderr
    last = rows(tmp_path / "run")[-1]
    name = f"model:{trained}"
    assert last[f"reward/{name}"] == pytest.approx(last["reward/mean"], abs=1e-6)
    assert 0 <= last["eval/reward/arithmetic_exact"] <= 1
    resolved = (tmp_path / "run" / "recipe.resolved.toml").read_text()
    assert str(trained / "checkpoints" / "step-000002" / MODEL_DIR) in resolved


def test_near_miss_pairs_have_no_order_shortcut():
    """``data.synthetic_rejected = "near_miss"``: each rejected answer is the right one moved by
    -3..-1 or 1..3, the same for a problem in every build, both sides about equally often (so
    "the smaller number wins" orders about half the pairs), and the pair stream's identity says
    which rule made it; the default keeps the answer + 1 of DPO's recipes."""
    from runner.data.pairs import near_miss_offset
    from runner.data.preference import build_pair_source

    near = load_recipe(REPO / RECIPE, ["data.synthetic_rejected=near_miss"])
    plus = load_recipe(REPO / RECIPE, [])
    a, b = build_pair_source(near.data), build_pair_source(near.data)
    pairs = [a.pair(i) for i in range(400)]
    offsets = [int(p.rejected) - int(p.chosen) for p in pairs]
    assert set(offsets) == {-3, -2, -1, 1, 2, 3}
    assert 0.4 < sum(o < 0 for o in offsets) / len(offsets) < 0.6
    assert [b.pair(i) for i in range(400)] == pairs
    assert all(near_miss_offset(str(k)) in (-3, -2, -1, 1, 2, 3) for k in range(1000))
    one = build_pair_source(plus.data)
    assert all(int(one.pair(i).rejected) - int(one.pair(i).chosen) == 1 for i in range(50))
    assert a.fingerprint() != one.fingerprint()
    with pytest.raises(RecipeError) as info:
        load_recipe(REPO / "recipes/grpo-arith.toml", ["data.synthetic_rejected=near_miss"])
    assert "data.synthetic_rejected" in str(info.value)


def test_ppo_takes_its_critic_and_its_reward_from_a_reward_model_run_folder(trained, tmp_path):
    """``rm -> ppo``: ``algo.critic_path`` names the reward model's run folder; the critic's
    body is the reward model's (1e-6 after a step at critic lr 1e-9; two reward-model steps
    moved it from the built-in model by far more), and the resolved recipe records the
    checkpoint it means. The same folder is PPO's only reward (``model:PATH``), logged under
    its own name."""
    import tomllib

    from safetensors.torch import load_file

    out = tmp_path / "ppo"
    done = run_subprocess("recipes/ppo-arith.toml", out, "run.max_steps=1",
                          "algo.prompts_per_step=4", "data.validation.enabled=false",
                          "logging.sample_every=0", f"algo.critic_path={trained}",
                          "algo.critic_lr=1e-9", f'reward.functions=["model:{trained}"]')
    assert done.returncode == 0, done.stdout + done.stderr
    model = trained / "checkpoints" / "step-000002" / MODEL_DIR
    resolved = tomllib.loads((out / "recipe.resolved.toml").read_text())["resolved"]
    assert resolved["models"] == {"algo.critic_path": str(model),
                                  "reward.functions[0]": str(model)}
    last = rows(out)[-1]
    assert math.isfinite(last[f"reward/model:{trained}"]) and "reward/arithmetic_exact" not in last
    body = {k.removeprefix("model."): v for k, v in load_file(model / "model.safetensors").items()
            if k.startswith("model.")}
    critic = load_file(out / "checkpoints" / "step-000001" / "extra_models" / "critic"
                       / "model.safetensors")
    start = load_causal_lm(resolve_model_path("builtin:tiny-arith")).state_dict()
    assert set(body) == {k.removeprefix("backbone.") for k in critic if k.startswith("backbone.")}
    assert max(float((critic[f"backbone.{k}"] - v).abs().max()) for k, v in body.items()) < 1e-6
    assert max(float((start[f"model.{k}"] - v).abs().max()) for k, v in body.items()) > 1e-4
