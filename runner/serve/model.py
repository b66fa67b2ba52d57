"""The model ``posttrain-run serve`` answers with: the recipe's engine, DataPacker and chat
template, built as a run builds them (``runner.train.assembly.build``), over the recipe's model
or a checkpoint of its run (a LoRA checkpoint's adapters merged and pushed to the engine, as
``eval`` does).

One thread owns the engine. Requests wait in a queue; the thread takes every request waiting
when it is free and runs those that sample alike as one ``generate`` call (each prompt seeded
on its own, so a request's completions do not depend on which others share the call): the hf
engine batches them, vLLM schedules them continuously inside the call.
"""

from __future__ import annotations

import queue
import secrets
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import attrs

from runner.errors import RunnerError
from runner.recipe.schema import Recipe
from runner.rollout.base import RolloutOutput, SamplingConfig
from runner.rollout.openai_api import ApiError, ChatRequest, Choice, Sampling, bad, choices

_STOP = object()


@attrs.frozen
class _Job:
    prompts: tuple[tuple[int, ...], ...]
    sampling: SamplingConfig
    seeds: tuple[int, ...]
    done: Future[list[RolloutOutput]]


class ServedModel:
    """The recipe's policy behind a queue; ``submit`` is safe from any thread."""

    def __init__(self, recipe: Recipe, checkpoint: Path | None) -> None:
        from runner.precision import device_type, resolve
        from runner.rollout.lengths import stated_limit
        from runner.state.layout import MODEL_DIR
        from runner.train.assembly.build import BuildSteps, engine_for, open_model, packer_for
        from runner.train.assembly.seeds import seed_everything

        self.recipe = recipe
        precision = resolve(recipe, device_type(recipe))
        seed_everything(recipe.run.seed, recipe.run.deterministic)
        step = BuildSteps()
        folder = open_model(recipe, step)
        packer = step("policy", lambda: packer_for(recipe, folder)) if folder else None
        if step.failed is not None or folder is None or packer is None:
            role, exc = step.failed or ("policy", RunnerError("the model did not build"))
            raise RunnerError(f"serve: the {role} could not be built: {exc}") from exc
        self.packer = packer
        self.limit = stated_limit(recipe, folder.path)
        lora = recipe.model.lora.rank > 0
        engine_dir = checkpoint / MODEL_DIR if checkpoint is not None and not lora else folder.path
        self.engine = engine_for(recipe, engine_dir, precision, self.limit)
        if checkpoint is not None and lora:  # the adapters merged into the base weights
            from runner.train.roles.policy import checkpoint_policy

            merged = checkpoint_policy(recipe, checkpoint)
            self.engine.update_weights((n, w.detach()) for n, w in merged.named_parameters())
            del merged
        self._queue: queue.Queue[Any] = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="serve-engine", daemon=True)
        self._thread.start()

    @property
    def max_new_tokens(self) -> int:
        """The most new tokens a request may ask for (the model's context, when known)."""
        return self.limit.max_model_len - 1 if self.limit.max_model_len else 1 << 20

    # --- requests ---------------------------------------------------------------------------
    def chat_prompt(self, request: ChatRequest) -> tuple[int, ...]:
        """The prompt's token ids as the packer's chat template renders the messages."""
        try:
            ids = self.packer.render_messages([dict(m) for m in request.messages],
                                              [dict(t) for t in request.tools] or None,
                                              add_generation_prompt=True)
        except NotImplementedError as exc:
            raise ApiError(400, f"messages: this model's DataPacker renders no chat ({exc})",
                           "messages") from exc
        except Exception as exc:  # the template refused the conversation (jinja raises)
            raise bad("messages", f"the chat template cannot render them: {exc}") from exc
        return tuple(ids)

    def text_prompt(self, prompt: str | tuple[int, ...]) -> tuple[int, ...]:
        if isinstance(prompt, tuple):
            return prompt
        return tuple(self.packer.encode_with_offsets(prompt)[0])

    def submit(self, prompt: tuple[int, ...], sampling: Sampling) -> Future[list[RolloutOutput]]:
        """Queue one prompt; the future's result is its ``RolloutOutput`` in a list."""
        limit = self.limit.max_model_len
        if limit is not None and len(prompt) + sampling.max_tokens > limit:
            raise ApiError(400, f"the prompt is {len(prompt)} tokens; with max_tokens "
                           f"{sampling.max_tokens} it exceeds the model's {limit} tokens "
                           f"({self.limit.why})", "messages")
        rollout = self.recipe.rollout
        config = SamplingConfig(n=sampling.n, max_new_tokens=sampling.max_tokens,
                                temperature=sampling.temperature or 1.0, top_p=sampling.top_p,
                                top_k=rollout.top_k, greedy=sampling.temperature == 0)
        seed = sampling.seed if sampling.seed is not None else secrets.randbits(31)
        done: Future[list[RolloutOutput]] = Future()
        self._queue.put(_Job((prompt,), config, (seed % (1 << 63),), done))
        return done

    def close(self) -> None:
        self._queue.put(_STOP)
        self._thread.join(timeout=30)
        self.engine.close()

    def _work(self) -> None:
        """Take every waiting request, run those that sample alike as one call."""
        while True:
            jobs = [self._queue.get()]
            while True:
                try:
                    jobs.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stop = _STOP in jobs
            groups: dict[SamplingConfig, list[_Job]] = {}
            for job in jobs:
                if job is not _STOP:
                    groups.setdefault(job.sampling, []).append(job)
            for config, group in groups.items():
                self._run(config, group)
            if stop:
                return

    def _run(self, config: SamplingConfig, group: list[_Job]) -> None:
        prompts = [p for job in group for p in job.prompts]
        seeds = [s for job in group for s in job.seeds]
        try:
            outputs = self.engine.generate(prompts, config, seeds)
        except Exception as exc:  # every request of the call gets the error
            for job in group:
                job.done.set_exception(exc)
            return
        at = 0
        for job in group:
            job.done.set_result(outputs[at:at + len(job.prompts)])
            at += len(job.prompts)

    def choices(self, output: RolloutOutput, sampling: Sampling, *, chat: bool,
                tools: bool) -> list[Choice]:
        """The output's completions as answered (``runner.rollout.openai_api.choices``)."""
        return choices(self.packer, output, sampling, chat=chat, tools=tools)
