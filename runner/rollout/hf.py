"""The ``hf`` engine: transformers ``generate`` in this process, batched with left padding.

It keeps its own copy of the model in eval mode; ``update_weights`` copies the policy's tensors
into it in place. Sampling is deterministic under ``SamplingConfig.seed``: each batch draws from
a forked RNG seeded with (seed, batch index), so the caller's RNG state is left untouched.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from runner.rollout.base import Completion, RolloutOutput, SamplingConfig, trim_at_eos


class HFEngine:
    name = "hf"

    def __init__(self, model: Any, tokenizer: Any, *, batch_size: int = 64) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.eos_token_id = int(tokenizer.eos_token_id)
        pad = tokenizer.pad_token_id
        self.pad_token_id = int(pad if pad is not None else self.eos_token_id)

    @classmethod
    def from_path(cls, model_path: str, *, dtype: str = "float32", batch_size: int = 64,
                  trust_remote_code: bool = False) -> HFEngine:
        from runner.models import load_causal_lm, load_tokenizer

        return cls(load_causal_lm(model_path, dtype=dtype, trust_remote_code=trust_remote_code),
                   load_tokenizer(model_path, trust_remote_code=trust_remote_code),
                   batch_size=batch_size)

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig) -> list[RolloutOutput]:
        flat = [list(p) for p in prompts for _ in range(sampling.n)]
        completions: list[Completion] = []
        for index, start in enumerate(range(0, len(flat), self.batch_size)):
            completions += self._generate_batch(flat[start:start + self.batch_size], sampling, index)
        n = sampling.n
        return [RolloutOutput(tuple(int(t) for t in p), tuple(completions[i * n:(i + 1) * n]))
                for i, p in enumerate(prompts)]

    def _generate_batch(self, batch: list[list[int]], s: SamplingConfig, index: int) -> list[Completion]:
        from transformers import GenerationConfig

        device = next(self.model.parameters()).device
        width = max(len(p) for p in batch)
        input_ids = torch.full((len(batch), width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(batch), width), dtype=torch.long)
        for row, p in enumerate(batch):
            input_ids[row, width - len(p):] = torch.tensor(p)
            attention[row, width - len(p):] = 1
        config = GenerationConfig(
            do_sample=not s.greedy, temperature=s.temperature if not s.greedy else 1.0,
            top_p=s.top_p if not s.greedy else 1.0, top_k=0 if s.greedy else s.top_k,
            max_new_tokens=s.max_new_tokens, pad_token_id=self.pad_token_id,
            eos_token_id=self.eos_token_id, output_logits=True, return_dict_in_generate=True)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(s.seed * 1_000_003 + index)
            out = self.model.generate(input_ids=input_ids.to(device), attention_mask=attention.to(device),
                                      generation_config=config)
        new_BT = out.sequences[:, width:].cpu()
        temperature = 1.0 if s.greedy else s.temperature
        logits_BTV = torch.stack(out.logits, dim=1).float().cpu() / temperature
        lp_BT = torch.log_softmax(logits_BTV, dim=-1).gather(-1, new_BT.unsqueeze(-1)).squeeze(-1)
        result = []
        for row in range(len(batch)):
            ids, finish = trim_at_eos(new_BT[row].tolist(), self.eos_token_id)
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            result.append(Completion(tuple(ids), text, tuple(lp_BT[row, :len(ids)].tolist()), finish))
        return result

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.model.named_parameters())
        for name, tensor in named_tensors:
            if name in params:
                params[name].copy_(tensor.to(params[name].dtype))

    def close(self) -> None:
        self.model = None
