"""The ``hf`` engine: transformers ``generate`` in this process, batched with left padding.

It keeps its own copy of the model in eval mode (``update_weights`` copies the policy's tensors
into it in place), or generates with the policy's own module (``shares_weights``). A prompt's
samples share one prefill: its key/value cache is computed once and copied into their rows.
Sampling draws every row's tokens from that row's own ``torch.Generator``,
seeded from its prompt's seed and its sample index: a completion depends on its prompt, its
seed and the weights, not on the other rows of the batch (or on how many ranks share the
work), and no global RNG (CPU or CUDA) is read or changed.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from runner.errors import RunnerError
from runner.packers.base import EnginePrompt, as_engine_prompt
from runner.rollout.base import Completion, RolloutOutput, SamplingConfig, prompt_seeds, trim_at_eos


def filtered_probs(logits_BV: torch.Tensor, temperature: float, top_k: int, top_p: float
                   ) -> torch.Tensor:
    """The sampling distribution: softmax(logits / temperature), cut to the ``top_k`` most
    likely tokens (0: off), then to the smallest set whose mass reaches ``top_p``; float64."""
    probs = torch.softmax(logits_BV.double() / temperature, dim=-1)
    if 0 < top_k < probs.shape[-1]:
        kth = probs.topk(top_k, dim=-1).values[:, -1:]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_p.cumsum(-1) - sorted_p
        keep_sorted = mass_before < top_p * sorted_p.sum(-1, keepdim=True)
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = torch.where(keep, probs, torch.zeros_like(probs))
    return probs / probs.sum(-1, keepdim=True)


class RowSampler:
    """Samples each row with its own generator (inverse CDF). A row's uniforms are drawn up front,
    ``steps`` of them in one call per generator: the same numbers, in the same order, as one draw
    per token (the CPU generator fills a tensor element by element), without a call per row and
    token."""

    def __init__(self, seeds: Sequence[int], s: SamplingConfig, steps: int) -> None:
        self.uniforms = torch.stack([
            torch.rand(steps, generator=torch.Generator().manual_seed(int(seed)),
                       dtype=torch.float64) for seed in seeds])
        self.step = 0
        self.s = s

    def choose(self, scores: torch.Tensor) -> torch.Tensor:
        """Each row's next token, a column on ``scores``' device."""
        probs = filtered_probs(scores, self.s.temperature, self.s.top_k, self.s.top_p).cpu()
        u = self.uniforms[:, self.step]
        self.step += 1
        cdf = probs.cumsum(-1)
        choice = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1)).clamp(
            max=probs.shape[-1] - 1)
        return choice.to(scores.device)


class ChosenLogprobs:
    """The logits processor ``generate`` runs: picks each row's token (``inner`` samples it;
    without one, greedy) and leaves only that token (so ``generate``'s greedy decoding emits it),
    keeping, step by step, the token's log-probability (at ``temperature``, from the raw logits),
    so ``generate`` need not hold every step's full-vocabulary logits until the end."""

    def __init__(self, inner: RowSampler | None, temperature: float) -> None:
        self.inner = inner
        self.temperature = temperature
        self.steps: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.inner is None:
            chosen, out = scores.argmax(-1, keepdim=True), scores
        else:
            chosen = self.inner.choose(scores)
            out = torch.full_like(scores, float("-inf")).scatter(1, chosen, 0.0)
        lp = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        self.steps.append(lp.gather(-1, chosen).squeeze(-1))  # stays on the device
        return out

    def logprobs(self) -> torch.Tensor:
        """The kept log-probabilities, rows x steps, on the CPU."""
        return torch.stack(self.steps, dim=1).cpu()


def left_padded_inputs(prompts: Sequence[EnginePrompt], width: int) -> dict[str, torch.Tensor]:
    """The prompts' processor inputs as one batch: ``hf_token_inputs`` left-padded with 0 to
    ``width`` like the ids, ``hf_inputs`` (pixel values, grids) concatenated along dim 0 in row
    order (rows without one skipped)."""
    out: dict[str, torch.Tensor] = {}
    for k in sorted({k for p in prompts for k in p.hf_token_inputs}):
        grid = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, p in enumerate(prompts):
            values = p.hf_token_inputs.get(k, ())
            if values:
                grid[row, width - len(values):] = torch.tensor(values, dtype=torch.long)
        out[k] = grid
    for k in sorted({k for p in prompts for k in p.hf_inputs}):
        out[k] = torch.cat([p.hf_inputs[k] for p in prompts if k in p.hf_inputs], dim=0)
    return out


def row_seed(prompt_seed: int, sample: int) -> int:
    return (prompt_seed * 1_000_003 + sample * 7_919 + 1) % 2**63


class HFEngine:
    name = "hf"
    shared = False  # one engine per rank

    def __init__(self, model: Any, tokenizer: Any, *, batch_size: int = 128,
                 max_model_len: int | None = None, shares_weights: bool = False) -> None:
        """``shares_weights``: ``model`` is the trained policy's own module (not a copy): it is
        put in eval mode for each generate call and back in the mode it had after, and
        ``update_weights`` has nothing to copy."""
        self.shares_weights = shares_weights
        self.model = model if shares_weights else model.eval()
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.max_model_len = max_model_len
        self.eos_token_id = int(tokenizer.eos_token_id)
        pad = tokenizer.pad_token_id
        self.pad_token_id = int(pad if pad is not None else self.eos_token_id)

    @classmethod
    def from_path(cls, model_path: str, *, dtype: str = "float32", batch_size: int = 128,
                  trust_remote_code: bool = False, max_model_len: int | None = None,
                  compiled: bool = False) -> HFEngine:
        """An engine on its own copy of the model in ``model_path``; ``compiled``: its forwards
        through ``torch.compile`` (``runner.models.compiled``, ``train.compile``)."""
        from runner.models import load_causal_lm, load_tokenizer

        model = load_causal_lm(model_path, dtype=dtype, trust_remote_code=trust_remote_code)
        if compiled:
            from runner.models.compiled import compile_forwards

            compile_forwards(model)
        return cls(model, load_tokenizer(model_path, trust_remote_code=trust_remote_code),
                   batch_size=batch_size, max_model_len=max_model_len)

    @torch.no_grad()
    def generate(self, prompts: Sequence[EnginePrompt | Sequence[int]], sampling: SamplingConfig,
                 seeds: Sequence[int] | None = None) -> list[RolloutOutput]:
        prompts = [as_engine_prompt(p) for p in prompts]
        self._check_lengths(prompts, sampling.max_new_tokens)
        per_prompt = prompt_seeds(sampling, len(prompts), seeds)
        flat = [(p, row_seed(seed, j)) for p, seed in zip(prompts, per_prompt, strict=True)
                for j in range(sampling.n)]
        completions: list[Completion] = []
        with self._evaluating():
            for start in range(0, len(flat), self.batch_size):
                completions += self._generate_batch(flat[start:start + self.batch_size],
                                                    sampling)
        n = sampling.n
        return [RolloutOutput(p.token_ids, tuple(completions[i * n:(i + 1) * n]))
                for i, p in enumerate(prompts)]

    @contextmanager
    def _evaluating(self) -> Iterator[None]:
        """The model in eval mode while it generates (a shared policy goes back to training
        mode after)."""
        training = self.model.training
        self.model.eval()
        try:
            yield
        finally:
            self.model.train(training)

    def _check_lengths(self, prompts: Sequence[EnginePrompt], max_new_tokens: int) -> None:
        """Refuse a prompt that leaves no room for ``max_new_tokens`` in ``max_model_len`` (as
        vLLM does; the run refuses such prompts earlier, naming their rows)."""
        if self.max_model_len is None:
            return
        for n, p in enumerate(prompts):
            if len(p.full_ids) + max_new_tokens > self.max_model_len:
                raise RunnerError(f"rollout: prompt {n} has {len(p.full_ids)} tokens; with "
                                  f"{max_new_tokens} new tokens it exceeds the hf engine's "
                                  f"max_model_len ({self.max_model_len})")

    def _generate_batch(self, rows: list[tuple[EnginePrompt, int]],
                        s: SamplingConfig) -> list[Completion]:
        from transformers import GenerationConfig, LogitsProcessorList

        device = next(self.model.parameters()).device
        batch = [p.full_ids for p, _ in rows]
        width = max(len(p) for p in batch)
        input_ids = torch.tensor([[*[self.pad_token_id] * (width - len(p)), *p] for p in batch],
                                 dtype=torch.long)
        attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch],
                                 dtype=torch.long)
        extras = {k: v.to(device)
                  for k, v in left_padded_inputs([p for p, _ in rows], width).items()}
        config = GenerationConfig(
            do_sample=False, max_new_tokens=s.max_new_tokens, pad_token_id=self.pad_token_id,
            eos_token_id=self.eos_token_id, return_dict_in_generate=True)
        sampler = None if s.greedy else RowSampler([r for _, r in rows], s, s.max_new_tokens)
        kept = ChosenLogprobs(sampler, 1.0 if s.greedy else s.temperature)
        input_ids, attention = input_ids.to(device), attention.to(device)
        cache = None if extras else self._shared_prefill(batch, input_ids, attention)
        out = self.model.generate(input_ids=input_ids, attention_mask=attention,
                                  generation_config=config, past_key_values=cache,
                                  logits_processor=LogitsProcessorList([kept]), **extras)
        new_rows = out.sequences[:, width:].cpu().tolist()
        lp_rows = kept.logprobs().tolist()
        result = []
        for new, lps in zip(new_rows, lp_rows, strict=True):
            ids, finish = trim_at_eos(new, self.eos_token_id)
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            result.append(Completion(tuple(ids), text, tuple(lps[:len(ids)]), finish))
        return result

    def _shared_prefill(self, batch: list[tuple[int, ...]], input_ids: torch.Tensor,
                        attention: torch.Tensor) -> Any:
        """The key/value cache of every row's prompt but its last token, computed once per
        distinct prompt (a group's samples share theirs) and copied to the rows that repeat it;
        None when no two rows share a prompt (or the prompts are one token wide). ``generate``
        then feeds each row's last prompt token and samples on. Text-only prompts: a prompt
        with processor inputs (images) takes ``generate``'s own prefill."""
        from transformers import DynamicCache

        first: dict[tuple[int, ...], int] = {}  # a prompt -> its row among the distinct
        distinct: list[int] = []  # the batch row each distinct prompt is first seen in
        index = []  # every batch row's distinct prompt
        for n, ids in enumerate(batch):
            if ids not in first:
                first[ids] = len(distinct)
                distinct.append(n)
            index.append(first[ids])
        if len(distinct) == len(batch) or input_ids.shape[1] < 2:
            return None
        rows = torch.tensor(distinct, device=input_ids.device)
        ids, mask = input_ids[rows, :-1], attention[rows, :-1]
        cache = DynamicCache(config=self.model.config)
        self.model(input_ids=ids, attention_mask=mask,
                   position_ids=(mask.cumsum(-1) - 1).clamp(min=0), past_key_values=cache,
                   use_cache=True, logits_to_keep=1)
        cache.reorder_cache(torch.tensor(index, device=input_ids.device))
        return cache

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy the policy's tensors in; a name this model does not have is an error (a stale
        engine must never go unnoticed). An engine that generates with the policy's own module
        (``shares_weights``) has them already."""
        if self.shares_weights:
            return
        params = dict(self.model.named_parameters())
        unknown = []
        for name, tensor in named_tensors:
            if name in params:
                params[name].copy_(tensor.to(params[name].dtype))
            else:
                unknown.append(name)
        if unknown:
            raise RunnerError(f"rollout: the hf engine's model has no parameter named "
                              f"{', '.join(unknown[:3])}{' ...' if len(unknown) > 3 else ''} "
                              f"({len(unknown)} unknown): the policy and engine models differ")

    def close(self) -> None:
        self.model = None
