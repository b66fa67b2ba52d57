"""Checking played episodes token by token against what the engine was asked and gave."""

from __future__ import annotations

from runner.envs.episodes import episode_seed, turn_seed


class Recording:
    """An engine wrapper that records (prompt ids, seed, reply ids, reply logprobs) per prompt."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def generate(self, prompts, sampling, seeds=None):
        outs = self.engine.generate(prompts, sampling, seeds)
        for prompt, seed, out in zip(prompts, seeds, outs, strict=True):
            c = out.completions[0]
            self.calls.append((list(prompt), seed, list(c.token_ids), list(c.logprobs)))
        return outs


def render(packer, messages, gen):
    text = packer.tokenizer.apply_chat_template(messages, tokenize=False,
                                                add_generation_prompt=gen)
    return packer.encode_rollout_input(text)


def check_token_exact(results, calls, packer, item_seeds, n):
    """Every episode is its prompt, then per turn the engine's reply to exactly the episode's
    tokens so far (found by the turn's seed) and, between turns, the chat template's rendering
    of the environment's messages after the conversation (computed here from the template,
    for a template that writes nothing after the assistant's eos); the loss mask is 1 on the
    replies only and the logprobs are the engine's."""
    by_seed = {seed: (prompt, reply, lps) for prompt, seed, reply, lps in calls}
    for j, s in enumerate(item_seeds):
        for k in range(n):
            r = results[j * n + k]
            e, msgs = episode_seed(s, k), list(r.messages)
            assistant_at = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
            assert render(packer, msgs[:assistant_at[0]], True) == list(r.prompt_ids)
            ids, mask, lps = [], [], []
            for t, at in enumerate(assistant_at):
                prompt, reply, lp = by_seed[turn_seed(e, t)]
                assert prompt == list(r.prompt_ids) + ids
                ids, mask, lps = ids + reply, mask + [1] * len(reply), lps + lp
                if t + 1 < len(assistant_at):
                    conv = msgs[:at + 1]
                    env = render(packer, msgs[:assistant_at[t + 1]], True)[
                        len(render(packer, conv, False)):]
                    ids, mask, lps = ids + env, mask + [0] * len(env), lps + [0.0] * len(env)
            assert list(r.completion.token_ids) == ids
            assert list(r.loss_mask) == mask
            assert list(r.completion.logprobs) == lps
