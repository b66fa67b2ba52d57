"""Multi-process runs (``launch.backend = "torchrun"``, gloo on 127.0.0.1): rank-correct from
data to checkpoint.

- the same world size reproduces bitwise, also across a stop, a Ctrl-C and a SIGKILL;
- 1 rank and 2 ranks on the same global batch train on the same items and, in float64, end
  with the same weights (to 1e-10 relative) for every algorithm;
- resuming on another world size continues the same items; a changed global batch is refused;
- a dead rank ends the job quickly, naming it, and the rerun resumes exactly;
- an external launcher's environment gives the same run as the built-in launcher.

vLLM on two ranks (each rank its own engine, in sync after every step) is checked in
test_ray.py, as the colocated run that Ray's separate rollout actor is compared with.
"""

from __future__ import annotations

import shutil
import signal
import time

import pytest
import torch

from runner.launch.payload import Payload
from runner.recipe import load_recipe
from runner.recipe.resolved import recipe_hash
from tests.conftest import RECIPES
from tests.multiproc import (
    descendants,
    item_ids,
    listeners_of,
    run_external,
    run_ranks,
    start_ranks,
)
from tests.resume_helpers import (
    assert_same_run,
    deterministic_rows,
    final_weights,
    wait_for_checkpoint,
    wait_for_step,
)

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

GRPO = "recipes/grpo-arith.toml"
N = 6
SMALL = ("algo.prompts_per_step=4", "algo.group_size=4", "algo.minibatches=2",
         "rollout.max_new_tokens=4", "data.validation.size=8", "train.eval_every=2",
         "checkpoint.every_steps=1", "checkpoint.keep_last=5", "logging.sample_every=0",
         "logging.item_ids=true")
FILES = ("model/model.safetensors", "optimizer.safetensors")


def test_worker_recipe_hashes_as_the_drivers():
    for path in RECIPES:
        recipe = load_recipe(path, ["launch.backend=torchrun", "launch.num_processes=2"]
                             if "smollm2" not in path.name else [])
        payload = Payload.of(recipe, source=str(path), overrides=(), cwd=".", plain=True)
        assert recipe_hash(payload.recipe()) == recipe_hash(recipe), path.name


def test_tampered_payload_is_refused():
    from runner.errors import RunnerError

    payload = Payload.of(load_recipe(GRPO), source=GRPO, overrides=(), cwd=".", plain=True)
    bad = Payload(payload.recipe_text.replace("seed = 0", "seed = 1"), payload.recipe_hash,
                  payload.source, (), ".", True)
    with pytest.raises(RunnerError, match="would not run the same recipe"):
        bad.recipe()


def test_bad_dotted_path_is_reported_by_the_driver(tmp_path):
    done = run_ranks(GRPO, tmp_path, 2, "data.factory=no_such_module.build")
    assert done.returncode == 2, done.stderr
    assert "data.factory" in done.stderr and "no_such_module" in done.stderr
    assert "rank" not in done.stderr  # the driver refused it: no rank was started
    assert not (tmp_path / "metrics.jsonl").exists()


def test_uneven_batch_is_a_recipe_error(tmp_path):
    done = run_ranks(GRPO, tmp_path, 3, "algo.prompts_per_step=4")
    assert done.returncode == 2
    assert "algo.prompts_per_step" in done.stderr and "launch.num_processes" in done.stderr




def _children(pid: int) -> list[int]:
    from pathlib import Path

    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return found


def _cmdline(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


@pytest.fixture(scope="module")
def forked_ranks(tmp_path_factory):
    """The module's straight run of ``N`` steps on two ranks, started as the CLI starts them
    (forked), watched while it runs: its folder, and every pair of rank pids seen that were
    the driver's own children from the zygote, each in a session of its own."""
    import os

    out = tmp_path_factory.mktemp("two")
    proc = start_ranks(GRPO, out, 2, f"run.max_steps={N}", *SMALL)
    seen: set[tuple[int, ...]] = set()
    while proc.poll() is None:
        ranks = tuple(sorted(c for c in _children(proc.pid)
                             if "runner.launch.zygote" in _cmdline(c)))
        if len(ranks) == 2 and all(os.getsid(c) == c for c in ranks):
            seen.add(ranks)
        time.sleep(0.1)
    output = proc.communicate()[0]
    assert proc.returncode == 0, output
    return out, seen


@pytest.fixture(scope="module")
def two_ranks(forked_ranks):
    return forked_ranks[0]


def test_forked_and_spawned_ranks_reproduce_bitwise(forked_ranks, tmp_path, monkeypatch):
    """The ranks start forked from one warm process (``runner.launch.zygote``) that then exits:
    while the module's run goes they are the driver's own children, each in a session of its
    own, and the zygote is gone. With ``POSTTRAIN_RANK_START=spawn`` each rank starts as a
    fresh interpreter instead; that run is bitwise the forked one."""
    forked, seen = forked_ranks
    assert len(seen) == 1, seen  # the same two ranks all along, and no third (the zygote)
    monkeypatch.setenv("POSTTRAIN_RANK_START", "spawn")
    done = run_ranks(GRPO, tmp_path / "spawned", 2, f"run.max_steps={N}", *SMALL)
    assert done.returncode == 0, done.stderr
    assert_same_run(tmp_path / "spawned", forked, N, FILES)
    assert len(item_ids(tmp_path / "spawned")) == N
    assert all(len(ids) == 4 for ids in item_ids(tmp_path / "spawned"))


def test_two_ranks_stopped_killed_and_interrupted_resume_exactly(two_ranks, tmp_path):
    """One run folder through every way a 2-rank job ends early, each rerun resuming where the
    last stopped, the last ending bitwise like the straight run:

    1. it stops at ``run.max_steps=2`` (exit 0; an evaluation step, as in the straight run);
    2. the rerun's listeners are on 127.0.0.1 only; after checkpoint 3 rank 1 is SIGKILLed: the
       job ends within 30 s naming it in one line (the survivor's broken-collective traceback
       goes to the run folder, not the terminal);
    3. the next rerun's whole job (driver and ranks) is SIGKILLed after checkpoint 4;
    4. the next is Ctrl-C'd once step 5 is logged: exit 130 after an agreed step, with a
       checkpoint;
    5. the last finishes.
    """
    import os

    assert run_ranks(GRPO, tmp_path, 2, "run.max_steps=2", *SMALL).returncode == 0

    proc = start_ranks(GRPO, tmp_path, 2, f"run.max_steps={N}", *SMALL)
    wait_for_step(proc, tmp_path, 3)
    addresses = listeners_of(descendants(proc.pid))
    assert addresses, "no listener seen while the ranks ran"
    assert all(a.startswith("127.0.0.1:") for a in addresses), addresses
    wait_for_checkpoint(proc, tmp_path, 3)
    ranks = sorted(descendants(proc.pid) - {proc.pid})
    assert len(ranks) == 2, ranks
    killed_at = time.monotonic()
    os.kill(ranks[1], signal.SIGKILL)
    code = proc.wait(timeout=60)
    output = proc.stdout.read()
    assert code == 1 and time.monotonic() - killed_at < 30, output
    assert "resuming" in output  # from step 2
    assert "Traceback" not in output, output
    last = output.strip().splitlines()[-1]
    assert last.startswith(f"error: rank 1 (pid {ranks[1]}) was killed by SIGKILL; the other "
                           "ranks were stopped"), output
    for trace in (tmp_path / "logs").glob("rank-*.traceback.txt"):
        assert trace.name == "rank-0.traceback.txt" and "Traceback" in trace.read_text()

    proc = start_ranks(GRPO, tmp_path, 2, f"run.max_steps={N}", *SMALL)
    wait_for_checkpoint(proc, tmp_path, 4)
    os.killpg(proc.pid, signal.SIGKILL)  # the driver and (through it) every rank
    proc.wait(timeout=30)
    time.sleep(0.5)

    proc = start_ranks(GRPO, tmp_path, 2, f"run.max_steps={N}", *SMALL,
                       "checkpoint.every_steps=100")
    wait_for_step(proc, tmp_path, 5)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
    assert proc.wait(timeout=120) == 130, proc.stdout.read()

    done = run_ranks(GRPO, tmp_path, 2, f"run.max_steps={N}", *SMALL)
    assert done.returncode == 0, done.stderr
    assert "resuming" in done.stdout
    assert_same_run(tmp_path, two_ranks, N, FILES)


def test_a_stopped_rank_ends_the_job_naming_it(tmp_path):
    """Rank 1's process is stopped (SIGSTOP) mid-run: rank 0 times out waiting for it in a
    collective, and the job ends with one line naming rank 1, not rank 0 that timed out."""
    import os

    proc = start_ranks(GRPO, tmp_path, 2, "run.max_steps=500", *SMALL,
                       "checkpoint.every_steps=100", "launch.collective_timeout_s=10")
    stopped = None
    try:
        wait_for_step(proc, tmp_path, 2)
        ranks = sorted(descendants(proc.pid) - {proc.pid})
        assert len(ranks) == 2, ranks
        stopped = ranks[1]
        os.kill(stopped, signal.SIGSTOP)
        stopped_at = time.monotonic()
        code = proc.wait(timeout=120)
        output = proc.stdout.read()
    finally:
        if stopped is not None:  # a stopped process the driver did not end must not stay behind
            try:
                os.kill(stopped, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert code == 1 and time.monotonic() - stopped_at < 60, output
    last = output.strip().splitlines()[-1]
    assert last.startswith(f"error: rank 1 (pid {stopped}) stopped answering (its process is "
                           "stopped, e.g. by SIGSTOP): rank 0 waited for it in a collective for "
                           "up to launch.collective_timeout_s = 10 s"), output
    assert "Traceback" not in output, output
    assert (tmp_path / "logs" / "rank-0.traceback.txt").is_file()


def test_external_launcher_gives_the_same_run(two_ranks, tmp_path):
    done = run_external(GRPO, tmp_path, 2, f"run.max_steps={N}", *SMALL)
    assert [d.returncode for d in done] == [0, 0], [d.stderr for d in done]
    assert_same_run(tmp_path, two_ranks, N, FILES)


# --- 1 rank vs 2 ranks -----------------------------------------------------------------------

ALGOS = {
    "grpo": (GRPO, ("algo.prompts_per_step=4", "algo.group_size=4", "algo.minibatches=2",
                    "train.grad_accum_steps=2", "rollout.max_new_tokens=4")),
    # the token budgets of the updates and of the scoring passes (policy, reference, critic):
    # micro-batch and pass counts that differ between the ranks
    "ppo": ("recipes/ppo-arith.toml", ("algo.prompts_per_step=4", "algo.minibatches=2",
                                       "rollout.max_new_tokens=4",
                                       "train.max_tokens_per_microbatch=30",
                                       "train.logprob_max_tokens_per_microbatch=40")),
    "opd": ("recipes/opd-arith.toml", ("algo.prompts_per_step=4", "train.grad_accum_steps=2",
                                       "rollout.max_new_tokens=4")),
    "dpo": ("recipes/dpo-arith.toml", ("algo.pairs_per_step=8", "train.grad_accum_steps=2")),
    # the GRPO family's global reductions: REINFORCE++'s normalisation over every rank's tokens
    # (with the KL in its rewards), GSPO's sequence ratios, the truncation mask's row weights
    "grpo-family": ("recipes/grpo-gspo-arith.toml", (
        "algo.prompts_per_step=4", "algo.group_size=4", "algo.minibatches=2",
        "train.grad_accum_steps=2", "rollout.max_new_tokens=4", "algo.advantage=reinforce_pp",
        "algo.kl_beta=0.05", "algo.gspo_clip_low=0.2", "algo.gspo_clip_high=0.2",
        "algo.mask_truncated=true")),
    # SFT sharded (FSDP2) on both world sizes: one process holds the whole model, two hold
    # half each
    "sft": ("recipes/sft-arith.toml", ("algo.examples_per_step=8", "train.grad_accum_steps=2",
                                       "train.sharding=fsdp")),
    # the token budget: two pairs a micro-batch, the ranks' counts gathered every step (pads
    # for a rank with fewer: tests/test_token_budget.py); unequal held-out shards
    "rm": ("recipes/rm-arith.toml", ("algo.pairs_per_step=8",
                                     "train.max_tokens_per_microbatch=58",
                                     "data.validation.size=7")),
}
COMMON = ("run.max_steps=3", "data.validation.size=8", "train.eval_every=3",
          "logging.item_ids=true",
          "logging.sample_every=0", "checkpoint.every_steps=1", "checkpoint.keep_last=5")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


# Padded batches: padding-free layouts share prompts within each rank's micro-batches, which
# differ with the world size, and RMSNorm computes in float32 whatever the model's dtype, so a
# shared prompt's summed gradient rounds at float32's level (tests/test_accumulation.py).
F64 = (*COMMON, "model.dtype=float64", "train.padding_free=false")


@pytest.fixture(scope="module")
def float64_runs(tmp_path_factory):
    """``algo -> {world: run folder}``: 3 float64 steps on 1 and on 2 ranks, run on first use
    (GRPO's also serve the tests that resume on another world size)."""
    made: dict[str, dict[int, object]] = {}

    def runs(algo: str) -> dict[int, object]:
        if algo not in made:
            recipe, extra = ALGOS[algo]
            root = tmp_path_factory.mktemp(f"f64-{algo}")
            for world in (1, 2):
                done = run_ranks(recipe, root / f"w{world}", world, *F64, *extra)
                assert done.returncode == 0, done.stdout + done.stderr
            made[algo] = {world: root / f"w{world}" for world in (1, 2)}
        return made[algo]

    return runs


@pytest.mark.parametrize("algo", sorted(ALGOS))
def test_one_rank_and_two_ranks_agree_in_float64(algo, float64_runs):
    runs = float64_runs(algo)
    assert item_ids(runs[1]) == item_ids(runs[2]) and len(item_ids(runs[1])) == 3
    one, two = final_weights(runs[1], 3), final_weights(runs[2], 3)
    assert one.keys() == two.keys()
    worst = max(_rel(two[k], one[k]) for k in one if one[k].norm() > 0)
    assert worst < 1e-10, worst
    start = final_weights(runs[1], 1)
    assert any(not torch.equal(start[k], one[k]) for k in one)  # training moved the weights


# Float32's own rounding bounds how closely layouts can agree. One rank sums a gradient over all
# of its tokens; two ranks sum halves, then the all-reduce adds the halves (and padding-free
# micro-batches share prompts differently), so the same terms are added in another order. With
# unit roundoff u = 2**-24 ~ 6e-8, a reordered float32 sum moves by up to ~n*u relative to the
# terms' magnitude, and the terms cancel (group advantages sum to 0). Measured relative gaps in
# the first step's gradient norm, 1 rank vs 2 (DDP and fsdp): 0.7e-7 to 2.5e-7 on an AVX-512
# BF16 CPU under each of torch's kernel levels (benchmarks/cpu_kinds.py), 2.1e-6 on an AVX-512
# CPU with avx512_fp16 (1.3110368 vs 1.3110396). In float64 the same layouts agree to ~1e-13
# (test_one_rank_and_two_ranks_agree_in_float64). 2e-5 (~300 u) leaves a tenfold margin over the
# largest gap seen and is still far below what a wrong reduction does (a rank's gradient counted
# twice or halved moves the norm by O(1)).
FLOAT32_LAYOUT_REL = 2e-5


def test_first_step_agrees_in_float32(tmp_path):
    """One rank, two DDP ranks and two sharded ranks (``train.sharding = "fsdp"``): the first
    step's items and rewards equal, its gradient norm and loss within float32's rounding of a
    reordered sum (``FLOAT32_LAYOUT_REL``)."""
    rows = {}
    for world, sharding in ((1, "none"), (2, "none"), (2, "fsdp")):
        out = tmp_path / f"w{world}-{sharding}"
        done = run_ranks(GRPO, out, world, *COMMON, *ALGOS["grpo"][1], "run.max_steps=1",
                         f"train.sharding={sharding}")
        assert done.returncode == 0, done.stderr
        rows[world, sharding] = deterministic_rows(out)[-1]
    one = rows[1, "none"]
    for two in (rows[2, "none"], rows[2, "fsdp"]):
        assert one["data/item_ids"] == two["data/item_ids"]
        assert one["reward/mean"] == two["reward/mean"]
        gap = abs(one["grad_norm"] - two["grad_norm"]) / abs(one["grad_norm"])
        assert gap <= FLOAT32_LAYOUT_REL, gap
        # The loss is a mean of advantage-weighted terms that nearly cancel (group advantages
        # sum to 0): its float32 error is relative to the size of those terms, ~|adv| = O(1).
        scale = max(abs(one["loss"]), one["adv_abs_mean"])
        assert abs(one["loss"] - two["loss"]) <= FLOAT32_LAYOUT_REL * scale, (one, two)


# --- another world size ----------------------------------------------------------------------

@pytest.mark.parametrize("first, second", [(2, 1), (1, 2)])
def test_resume_on_another_world_size_continues_the_items(first, second, float64_runs, tmp_path):
    """In float64, so that "within float tolerance" can be tight: 2 steps on ``first`` ranks,
    the third on ``second``, against the straight run on ``first``."""
    recipe, extra = ALGOS["grpo"]
    straight = float64_runs("grpo")[first]
    assert run_ranks(recipe, tmp_path, first, *F64, *extra, "run.max_steps=2").returncode == 0
    done = run_ranks(recipe, tmp_path, second, *F64, *extra)
    assert done.returncode == 0, done.stderr
    assert "resuming" in done.stdout
    assert item_ids(tmp_path) == item_ids(straight)
    one, two = final_weights(tmp_path, 3), final_weights(straight, 3)
    assert max(_rel(one[k], two[k]) for k in one if two[k].norm() > 0) < 1e-10


def test_resume_with_another_batch_and_world_is_refused(two_ranks, tmp_path):
    shutil.copytree(two_ranks, tmp_path, dirs_exist_ok=True)  # a 2-rank run's folder
    done = run_ranks(GRPO, tmp_path, 1, f"run.max_steps={N + 1}", *SMALL,
                     "algo.prompts_per_step=2")
    assert done.returncode == 2
    assert "launch.num_processes" in done.stderr and "algo.prompts_per_step" in done.stderr


def test_a_rank_that_cannot_build_stops_every_rank_naming_it(tmp_path):
    done = run_ranks(GRPO, tmp_path, 2, "run.max_steps=2", *SMALL, "data.validation.enabled=false",
                     "data.factory=tests.extmods.ranked.build_prompts",
                     "data.prompt_column=question", "data.response_column=answer")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "rank 0: error: rank 1 failed to build its data" in done.stderr
    assert "the data share is not mounted on this node" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "checkpoints").exists()


def test_external_launcher_with_another_world_size_than_the_recipe_is_refused(tmp_path):
    done = run_external(GRPO, tmp_path, 2, "run.max_steps=1", *SMALL, "launch.backend=torchrun",
                        "launch.num_processes=4")
    assert [d.returncode for d in done] == [2, 2]
    assert all("launch.num_processes" in d.stderr and "launcher started 2" in d.stderr
               for d in done)
