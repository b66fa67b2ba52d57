"""A trained reward model as a reward function: ``reward.functions = ["model:PATH"]``.

PATH is a sequence-classification folder with one output (what ``kind = "rm"`` checkpoints and
``posttrain-run export`` write, or any transformers ``*ForSequenceClassification`` folder with
``num_labels = 1``), or a run folder, meaning its newest complete checkpoint's model
(``runner.models.loading.run_model_folder``). The model is frozen and scores whole batches in
the process that holds the rewards (each rank, or each rank's actor under Ray), on that
process's device.

Scores are computed exactly as the reward-model run computed them, so a model scores the same in
training and in use: each (prompt, completion) is rendered by the folder's DataPacker as the
chosen answer of a preference pair (``get_preference_input``), batches are right-padded by the
packer, and the score is the head's output at each row's last token that is not the pad token
(``sequence_scores``, which the training loop uses too).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from runner.errors import Problem, RecipeError
from runner.recipe.reward_names import PREFIX
from runner.types import ObsBundle

BATCH = 32  # completions per forward


def reward_model_problems(path: str, key: str) -> list[Problem]:
    """Why ``path`` cannot be a reward model (nothing is loaded): it must resolve to a model
    folder (or a run folder with a complete checkpoint) whose config is a sequence
    classifier with one label."""
    from runner.models import resolve_model_path

    if not path:
        return [Problem(key, "names no reward model", got=PREFIX,
                        hint="write model:PATH, PATH a reward model's folder or its run folder")]
    try:
        folder = resolve_model_path(path, key=key)
    except RecipeError as exc:
        return list(exc.problems)
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return [Problem(key, f"{folder}/config.json cannot be read ({exc})", got=path)]
    architectures = config.get("architectures") or []
    if not any(str(a).endswith("ForSequenceClassification") for a in architectures):
        return [Problem(key, f"{folder} is not a reward model (its architectures are "
                        f"{architectures or 'not given'}, not a *ForSequenceClassification)",
                        got=path, hint="train one with algo.kind = 'rm', or give a "
                        "sequence-classification folder with num_labels = 1")]
    labels = len(config.get("id2label") or {}) or config.get("num_labels", 1)
    if labels != 1:
        return [Problem(key, f"{folder} has {labels} labels; a reward model scores with one",
                        got=path, hint="give a sequence-classification folder with "
                        "num_labels = 1")]
    return []


def sequence_scores(model: Any, batch: Any) -> Any:
    """A score model's scalar per row of ``batch`` [B] (float32 or wider): its forward as
    transformers runs it, the head's output at each row's last token that is not the pad token
    (``config.pad_token_id``), so a saved folder scores the same outside the runner."""
    from runner.algorithms.masked import at_least_float32

    out = model(input_ids=batch.input_ids_BT, use_cache=False, **batch.model_kwargs())
    return at_least_float32(out.logits[:, 0])


class ModelReward:
    """The reward function of one reward model: ``(completions, items) -> scores``.

    Loaded when first called (in the process that scores), on ``device`` in ``dtype``; calls are
    serialised (one forward at a time), and each batch of ``BATCH`` completions is one forward
    without gradients."""

    def __init__(self, path: str, key: str, *, device: Any = "cpu", dtype: str = "float32",
                 trust_remote_code: bool = False) -> None:
        self.path, self.key, self.device = path, key, device
        self.dtype, self.trust_remote_code = dtype, trust_remote_code
        self.__name__ = f"{PREFIX}{path}"
        self._loaded: tuple[Any, Any] | None = None
        self._lock = threading.Lock()

    @property
    def folder(self) -> Path:
        from runner.models import resolve_model_path

        return resolve_model_path(self.path, key=self.key)

    def load(self) -> tuple[Any, Any]:
        """(the frozen model, its packer), loaded once."""
        if self._loaded is None:
            from runner.models import load_causal_lm, read_model_type
            from runner.packers import build_packer

            folder = self.folder
            problems = reward_model_problems(str(folder), self.key)
            if problems:
                raise RecipeError(problems)
            model = load_causal_lm(folder, self.dtype, self.trust_remote_code, key=self.key,
                                   head="score").to(self.device)
            model.requires_grad_(False)
            packer = build_packer(folder, read_model_type(folder, key=self.key), "",
                                  key=self.key, trust_remote_code=self.trust_remote_code,
                                  dtype=self.dtype)
            self._loaded = (model, packer)
        return self._loaded

    def __call__(self, completions: Sequence[str], items: Sequence[ObsBundle]) -> list[float]:
        import torch

        with self._lock, torch.no_grad():
            model, packer = self.load()
            scores: list[float] = []
            for start in range(0, len(completions), BATCH):
                rows = [packer.get_preference_input(item, text, text)[0] for text, item in
                        zip(completions[start:start + BATCH], items[start:start + BATCH],
                            strict=True)]
                batch = packer.collate(rows).to(self.device)
                scores += [float(s) for s in sequence_scores(model, batch).double().tolist()]
            return scores
