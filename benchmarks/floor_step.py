"""A tiny GRPO, DPO or OPD step as bare eager torch and transformers calls: the floor under a
trainer that makes the same calls.

Each step is written out on the shipped recipes' models and shapes, with nothing a trainer adds
around it: the batches are tokenised and collated before the clock starts (padded; the runner
trains GRPO padding-free, which computes fewer positions), there are no metrics, no logging, no
data cursor, no checks.

    floor_step.py grpo [--steps 12]  # grpo-arith: 16 prompts x 8 samples, <= 6 new tokens,
                                     # two minibatches (optimizer steps), lr 5e-5
    floor_step.py dpo [--steps 40]   # dpo-arith: 16 pairs, beta 0.3, SFT weight 1, lr 3e-4
    floor_step.py opd [--steps 40]   # opd-arith: 16 prompts x 2 samples, <= 6 new tokens,
                                     # exact reverse KL against the teacher, lr 1e-4

GRPO: the policy samples with transformers' ``generate`` after one prefill per distinct prompt
(its key/value cache copied to the prompt's 8 rows, as the runner's hf engine does), the
arithmetic reward and group-normalised advantages, the old logprobs of the second minibatch
(no grad), then per minibatch the forward, the clipped surrogate (token mean), backward, fused
AdamW. DPO: the reference's forward (no grad), the policy's forward, the sigmoid loss plus the SFT
term, backward, fused AdamW. OPD: the student samples with transformers' ``generate``, the
teacher and the student score the sequences, the exact reverse KL over the vocabulary at every
completion token, backward, fused AdamW. Logits are computed only from the first completion
column on (``logits_to_keep``), as the runner does. ``--compile`` runs every model's forward
through ``torch.compile(dynamic=True)`` (the one way below the eager floor: fewer operations);
the warm-up steps then include the compilation. ``dpo --compile-scope loss`` compiles both
forwards and the loss as one graph instead, ``--compile-scope step`` the whole step (its
backward through compiled autograd, and the optimizer step): one phase, "whole step". Prints
the median milliseconds of the step and of each phase after ``--warmup`` steps, and the
warm-up's seconds, as JSON on the last line.

Comparing this floor with TRL's and the runner's steps measured in the same sitting
(``race_trl.py --floor``) says how much of a step a trainer around these calls could still
remove; going below the floor takes less torch work (fewer positions, fewer operations).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import defaultdict
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "2")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def _shifted(logits_BTV: torch.Tensor, ids_BT: torch.Tensor, start: int) -> torch.Tensor:
    """log p(token t+1 | tokens <= t) for the columns ``start ..``: [B, T-1-start]."""
    return torch.log_softmax(logits_BTV.float(), -1).gather(
        -1, ids_BT[:, start + 1:].unsqueeze(-1)).squeeze(-1)


def _positions(mask_BT: torch.Tensor) -> torch.Tensor:
    return (mask_BT.long().cumsum(-1) - 1).clamp(min=0)


COMPILE = False  # --compile


def _models(*names: str) -> tuple[Any, list[torch.nn.Module]]:
    """The first model's packer and the models ``names`` (forwards compiled under
    ``--compile``)."""
    from runner.models import load_causal_lm, read_model_type, resolve_model_path
    from runner.packers import build_packer

    paths = [resolve_model_path(n) for n in names]
    models = [load_causal_lm(p) for p in paths]
    if COMPILE:
        for m in models:
            m.forward = torch.compile(m.forward, dynamic=True)
    return build_packer(paths[0], read_model_type(paths[0])), models


def _adamw(model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr,
                             fused=True)


def _problems(args: argparse.Namespace, per_step: int) -> list[list[Any]]:
    """Each step's ``per_step`` arithmetic problems, warm-up steps first."""
    from runner.data.arithmetic import problems

    items = problems("train", per_step * (args.warmup + args.steps))
    return [items[i:i + per_step] for i in range(0, len(items), per_step)]


def _left_padded(packer: Any, part: list[Any], repeat: int = 1
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The rendered prompts of problems ``part`` (each ``repeat`` times), left-padded as
    ``generate`` reads a batch: ids and attention mask."""
    from runner.types import ObsBundle

    rows = [list(packer.engine_prompt(packer.get_rollout_input(ObsBundle(p.question)))
                 .token_ids) for p in part for _ in range(repeat)]
    width = max(map(len, rows))
    return (torch.tensor([[packer.pad_token_id] * (width - len(r)) + r for r in rows]),
            torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows]))


def _completion_mask(new_BT: torch.Tensor, eos: int) -> torch.Tensor:
    """The generated tokens up to and with each row's first EOS."""
    is_eos = (new_BT == eos).long()
    return (is_eos.cumsum(-1) - is_eos) == 0


def _completion_logprobs(model: torch.nn.Module, seq: torch.Tensor, mask: torch.Tensor,
                         pos: torch.Tensor, P: int, rows: slice) -> torch.Tensor:
    """Rows ``rows`` of ``seq``: the logprobs of the tokens after the ``P`` prompt columns."""
    logits = model(input_ids=seq[rows], attention_mask=mask[rows], position_ids=pos[rows],
                   use_cache=False, logits_to_keep=seq.shape[1] - P + 1).logits
    return _shifted(logits[:, :-1], seq[rows], P - 1)


class Clock:
    """Each step's phases: ``lap(name)`` adds the seconds since the last lap to ``name``;
    ``end()`` closes the step. Steps after ``warmup`` are kept; ``ms()`` gives the medians (and
    the warm-up's own milliseconds, compilation included with ``--compile``)."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.step = warmup, 0
        self.times: dict[str, list[float]] = defaultdict(list)
        self.begin = self.last = self.start = time.perf_counter()
        self.phases: dict[str, float] = defaultdict(float)

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] += now - self.last
        self.last = now

    def end(self) -> None:
        now = time.perf_counter()
        if self.step == self.warmup - 1:
            self.times["warmup"].append(now - self.begin)
        if self.step >= self.warmup:
            for k, v in {**self.phases, "step": now - self.start}.items():
                self.times[k].append(v)
        self.step, self.start, self.last, self.phases = self.step + 1, now, now, defaultdict(float)

    def ms(self) -> dict[str, float]:
        return {k: 1000 * statistics.median(v) for k, v in self.times.items()}


def _update(opt: torch.optim.Optimizer, loss: torch.Tensor, clock: Clock, forward: str,
            backward: str) -> None:
    """Backward and the optimizer step; the laps ``forward`` (up to now), ``backward`` and
    "optimizer"."""
    clock.lap(forward)
    loss.backward()
    clock.lap(backward)
    opt.step()
    opt.zero_grad(set_to_none=True)
    clock.lap("optimizer")


def dpo(args: argparse.Namespace) -> dict[str, float]:
    from runner.types import ObsBundle

    packer, (policy, reference) = _models("builtin:tiny-arith", "builtin:tiny-arith")
    reference.eval()
    policy.train()
    opt = _adamw(policy, 3e-4)
    n, beta = 16, 0.3
    batches = []
    for part in _problems(args, n):
        both = [packer.get_preference_input(ObsBundle(p.question, id=str(i)), str(p.answer),
                                            str(p.answer + 1)) for i, p in enumerate(part)]
        batch = packer.collate([c for c, _ in both] + [r for _, r in both])
        start = int(batch.loss_mask_BT[:, 1:].any(0).nonzero()[0])
        batches.append((batch.input_ids_BT, batch.attention_mask_BT,
                        batch.loss_mask_BT[:, 1 + start:].float(), start))

    def seq_logprobs(model: torch.nn.Module, ids: torch.Tensor, am: torch.Tensor,
                     mask: torch.Tensor, start: int) -> torch.Tensor:
        logits = model(input_ids=ids, attention_mask=am, use_cache=False,
                       logits_to_keep=ids.shape[1] - start).logits[:, :-1]
        return (_shifted(logits, ids, start) * mask).sum(-1)

    def loss_of(ids: torch.Tensor, am: torch.Tensor, mask: torch.Tensor, start: int
                ) -> torch.Tensor:
        with torch.no_grad():
            ref = seq_logprobs(reference, ids, am, mask, start)
        lp = seq_logprobs(policy, ids, am, mask, start)
        margin = beta * ((lp[:n] - ref[:n]) - (lp[n:] - ref[n:]))
        return -F.logsigmoid(margin).mean() - (lp[:n] / mask[:n].sum(-1)).mean()

    clock = Clock(args.warmup)
    if args.compile_scope != "forwards":  # more of the step in compiled graphs: one lap
        return _dpo_compiled_further(args.compile_scope, loss_of, opt, batches, clock)
    for ids, am, mask, start in batches:
        with torch.no_grad():
            ref = seq_logprobs(reference, ids, am, mask, start)
        clock.lap("reference")
        lp = seq_logprobs(policy, ids, am, mask, start)
        margin = beta * ((lp[:n] - ref[:n]) - (lp[n:] - ref[n:]))
        _update(opt, -F.logsigmoid(margin).mean() - (lp[:n] / mask[:n].sum(-1)).mean(), clock,
                "policy forward and loss", "backward")
        clock.end()
    return clock.ms()


def _dpo_compiled_further(scope: str, loss_of: Any, opt: torch.optim.Optimizer,
                          batches: list[Any], clock: Clock) -> dict[str, float]:
    """The DPO step with more than the forwards compiled (``--compile-scope``): "loss", both
    forwards and the loss in one graph (its backward compiled with it); "step", that graph's
    backward traced too (compiled autograd) and the optimizer step compiled."""
    if scope == "loss":
        compiled = torch.compile(loss_of, dynamic=True)

        def step(*batch: Any) -> None:
            compiled(*batch).backward()
            opt.step()
    else:
        torch._dynamo.config.compiled_autograd = True

        @torch.compile(dynamic=True)
        def forward_backward(*batch: Any) -> None:
            loss_of(*batch).backward()

        @torch.compile
        def optimize() -> None:
            opt.step()

        def step(*batch: Any) -> None:
            forward_backward(*batch)
            optimize()
    for batch in batches:
        step(*batch)
        opt.zero_grad(set_to_none=True)
        clock.lap("whole step")
        clock.end()
    return clock.ms()


def opd(args: argparse.Namespace) -> dict[str, float]:
    packer, (student, teacher) = _models("builtin:tiny-arith", "builtin:tiny-arith-teacher")
    teacher.eval()
    student.train()
    opt = _adamw(student, 1e-4)
    prompts, samples, new = 16, 2, 6
    eos = packer.eos_token_id
    batches = [_left_padded(packer, part, samples) for part in _problems(args, prompts)]
    torch.manual_seed(0)
    clock = Clock(args.warmup)
    for ids, am in batches:
        P = ids.shape[1]
        with torch.no_grad():
            seq = student.generate(input_ids=ids, attention_mask=am, do_sample=True,
                                   max_new_tokens=new, temperature=1.0, top_k=0, top_p=1.0,
                                   pad_token_id=packer.pad_token_id, eos_token_id=eos)
        comp = _completion_mask(seq[:, P:], eos)
        full_am = torch.cat([am, comp.long()], 1)
        kwargs = {"input_ids": seq, "attention_mask": full_am, "position_ids": _positions(full_am),
                  "use_cache": False, "logits_to_keep": seq.shape[1] - P + 1}
        clock.lap("generate")
        with torch.no_grad():
            t_logp = torch.log_softmax(teacher(**kwargs).logits[:, :-1].float(), -1)
        clock.lap("teacher")
        s_logp = torch.log_softmax(student(**kwargs).logits[:, :-1].float(), -1)
        kl = (s_logp.exp() * (s_logp - t_logp)).sum(-1)
        mask = comp.float()
        _update(opt, (kl * mask).sum() / mask.sum().clamp(min=1), clock,
                "student forward and loss", "backward")
        clock.end()
    return clock.ms()


def grpo(args: argparse.Namespace) -> dict[str, float]:
    from transformers import DynamicCache

    from runner.rewards.builtin import final_integer

    packer, (policy,) = _models("builtin:tiny-arith")
    opt = _adamw(policy, 5e-5)
    prompts, group, new, minibatches, clip = 16, 8, 6, 2, 0.2
    eos = packer.eos_token_id
    batches = [(*_left_padded(packer, part), [p.answer for p in part])
               for part in _problems(args, prompts)]
    torch.manual_seed(0)
    index = torch.arange(prompts).repeat_interleave(group)
    clock = Clock(args.warmup)
    for ids, am, answers in batches:
        P = ids.shape[1]
        policy.eval()
        with torch.no_grad():
            cache = DynamicCache(config=policy.config)
            policy(input_ids=ids[:, :-1], attention_mask=am[:, :-1],
                   position_ids=_positions(am[:, :-1]), past_key_values=cache, use_cache=True,
                   logits_to_keep=1)
            cache.reorder_cache(index)
            seq = policy.generate(input_ids=ids[index], attention_mask=am[index],
                                  past_key_values=cache, do_sample=True, max_new_tokens=new,
                                  temperature=1.0, top_k=0, top_p=1.0,
                                  pad_token_id=packer.pad_token_id, eos_token_id=eos)
        policy.train()
        clock.lap("rollout")
        comp = _completion_mask(seq[:, P:], eos)
        texts = packer.tokenizer.batch_decode(seq[:, P:], skip_special_tokens=True)
        reward = torch.tensor([float(final_integer(t) == answers[i // group])
                               for i, t in enumerate(texts)]).view(prompts, group)
        adv = ((reward - reward.mean(-1, keepdim=True))
               / (reward.std(-1, keepdim=True) + 1e-6)).view(-1, 1)
        full_am = torch.cat([am[index], comp.long()], 1)
        pos, mask = _positions(full_am), comp.float()
        per = len(seq) // minibatches

        rows = [slice(m * per, (m + 1) * per) for m in range(minibatches)]
        with torch.no_grad():  # the later minibatches' old logprobs, before any update
            old_rest = _completion_logprobs(policy, seq, full_am, pos, P, slice(per, None))
        clock.lap("reward and old logprobs")
        for m, r in enumerate(rows):
            lp = _completion_logprobs(policy, seq, full_am, pos, P, r)
            old = lp.detach() if m == 0 else old_rest[(m - 1) * per:m * per]
            ratio = torch.exp(lp - old)
            surrogate = torch.minimum(ratio * adv[r], ratio.clamp(1 - clip, 1 + clip) * adv[r])
            _update(opt, -(surrogate * mask[r]).sum() / mask[r].sum().clamp(min=1), clock,
                    "forwards and losses", "backwards")
        clock.end()
    return clock.ms()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("algo", choices=["grpo", "dpo", "opd"])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--compile", action="store_true",
                        help="compile every model's forward (torch.compile, dynamic shapes)")
    parser.add_argument("--compile-scope", choices=["forwards", "loss", "step"],
                        default="forwards",
                        help="dpo: what is compiled: the forwards (with --compile), both "
                        "forwards and the loss in one graph, or the whole step (the backward "
                        "through compiled autograd, the optimizer step too)")
    args = parser.parse_args()
    global COMPILE
    COMPILE = args.compile and args.compile_scope == "forwards"
    if args.compile_scope != "forwards" and args.algo != "dpo":
        parser.error("--compile-scope loss/step: dpo only")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    ms = {"grpo": grpo, "dpo": dpo, "opd": opd}[args.algo](args)
    for k, v in ms.items():
        print(f"{k:>26}: {v:7.2f} ms" if k != "warmup" else f"{k:>26}: {v / 1000:7.1f} s")
    print(json.dumps({"algo": args.algo, "ms": ms}))


if __name__ == "__main__":
    main()
