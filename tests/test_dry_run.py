"""--dry-run end to end: data built as a run builds it, the packer's rollout input, the plan."""

from __future__ import annotations

import pytest

GRPO = "recipes/grpo-arith.toml"
FACTORY = "examples.posttrain_extensions.build_prompt_dataset"


def test_builtin_source_shows_size_item_fingerprint_and_rollout_input(run_cli):
    rc, out, err = run_cli("--plain", "--dry-run", GRPO)
    assert rc == 0, err
    assert "dataset size" in out and "2000" in out
    assert '"prompt": "What is' in out and "fingerprint" in out
    assert "rollout input" in out and "<|assistant|>" in out
    assert "nothing is trained" in out and "[algo]" in out


def test_factory_source_with_overrides_and_custom_packer(run_cli):
    rc, out, err = run_cli("--plain", "--dry-run", GRPO, f"data.factory={FACTORY}",
                           "data.factory_kwargs.count=1000", "data.prompt_column=question",
                           "data.response_column=answer",
                           "data.validation.factory=examples.posttrain_extensions.build_held_out_prompt_dataset",
                           "data_packer.factory=examples.posttrain_extensions.build_default_packer")
    assert rc == 0, err
    assert "1000" in out and '"prompt": "What is 0 + 7?"' in out and '"reference": "7"' in out
    assert "'<domain><|bos|>" in out  # the subclass's prefix is in the packed rollout input
    assert "DomainTaggedPacker" in out


def test_file_source(run_cli):
    rc, out, err = run_cli("--plain", "--dry-run", "examples/files-grpo.toml")
    assert rc == 0, err
    assert "prompts.jsonl" in out and '"prompt": "What is 12 + 30?"' in out


def test_dpo_dry_run_shows_packed_pair(run_cli):
    rc, out, err = run_cli("--plain", "--dry-run", "recipes/dpo-arith.toml")
    assert rc == 0, err
    assert "chosen sequence" in out and "rejected sequence" in out


def test_missing_column_exits_2_listing_columns(run_cli):
    rc, _, err = run_cli("--plain", "--dry-run", GRPO, f"data.factory={FACTORY}",
                         "data.prompt_column=q",
                         "data.validation.factory=examples.posttrain_extensions.build_held_out_prompt_dataset")
    assert rc == 2
    assert "column 'q'" in err and "'question'" in err and "Traceback" not in err


def test_hub_name_fails_fast_offline(run_cli, monkeypatch):
    """Nothing leaves the machine: the hub endpoint is a loopback port nothing listens on, so
    the probe is refused and datasets is asked from its cache only."""
    import datasets.config
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.delenv("HTTPS_PROXY", raising=False)
    monkeypatch.delenv("https_proxy", raising=False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    rc, _, err = run_cli("--plain", "--dry-run", GRPO, "data.name=nobody/no-such-dataset",
                         "data.validation.enabled=false")
    assert rc == 2
    assert ("data.name: cannot load hub dataset nobody/no-such-dataset: the hub cannot be "
            "reached (127.0.0.1:9: ") in err, err
    assert "Traceback" not in err


def test_dpo_answer_payload_the_packer_cannot_read_is_one_line(run_cli):
    rc, out, err = run_cli("--plain", "--dry-run", "recipes/dpo-arith.toml",
                           "data.factory=tests.extmods.callables.caption_pairs",
                           "data.synthetic_pairs=0", "data.validation.enabled=false")
    assert rc == 2 and "Traceback" not in err
    assert err.startswith("data_packer.factory: pair train-0: the chosen answer is a mapping with "
                          "keys ['caption', 'image'], which DecoderOnlyLLMDataPacker cannot turn "
                          "into text"), err
    assert len(err.splitlines()) == 1


# The roles the plan lists are the roles the assembly builds
# (runner.train.assembly.assemble.build_roles reads plan.roles): --dry-run shows them.
ROLE_CASES = [
    ("grpo-arith", (), ("driver", "policy", "rollout", "reward")),
    ("grpo-arith", ("algo.kl_beta=0.05",), ("driver", "policy", "rollout", "reference", "reward")),
    ("ppo-arith", ("algo.kl_coef=0.0",), ("driver", "policy", "rollout", "critic", "reward")),
    ("ppo-arith", ("algo.kl_coef=0.05",),
     ("driver", "policy", "rollout", "reference", "critic", "reward")),
    ("dpo-arith", (), ("driver", "policy", "rollout", "reference", "reward")),
    ("dpo-arith", ("data.validation.enabled=false",), ("driver", "policy", "reference")),
    ("opd-arith", (), ("driver", "policy", "rollout", "teacher", "reward")),
]


@pytest.mark.parametrize(("recipe", "overrides", "roles"), ROLE_CASES)
def test_plan_lists_the_roles_a_run_builds(repo, recipe, overrides, roles):
    from runner.recipe import load_recipe, make_plan

    plan = make_plan(load_recipe(repo / "recipes" / f"{recipe}.toml", list(overrides)))
    assert plan.roles == roles
    rows = dict(plan.rows())
    assert rows["roles"] == ", ".join(roles)
    engine = rows["rollout engine"]
    if "rollout" not in roles:
        assert engine == "(none: offline pairs)"
    elif recipe.startswith("dpo"):
        assert engine.endswith("(held-out generation only)")


def test_dry_run_shows_a_dpo_held_out_engine(run_cli):
    rc, out, _ = run_cli("--plain", "--dry-run", "recipes/dpo-arith.toml")
    assert rc == 0
    assert "driver, policy, rollout, reference, reward" in out
    assert "(held-out generation only)" in out
