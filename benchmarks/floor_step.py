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
the warm-up steps then include the compilation. Prints the median milliseconds of the step and
of each phase after ``--warmup`` steps, and the warm-up's seconds, as JSON on the last line.

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

os.environ.setdefault("OMP_NUM_THREADS", "2")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def _shifted(logits_BTV: torch.Tensor, ids_BT: torch.Tensor, start: int) -> torch.Tensor:
    """log p(token t+1 | tokens <= t) for the columns ``start ..``: [B, T-1-start]."""
    return torch.log_softmax(logits_BTV.float(), -1).gather(
        -1, ids_BT[:, start + 1:].unsqueeze(-1)).squeeze(-1)


def _load(*args: object, **kwargs: object) -> torch.nn.Module:
    """``load_causal_lm``, its forward compiled under ``--compile``."""
    from runner.models import load_causal_lm

    model = load_causal_lm(*args, **kwargs)
    if COMPILE:
        model.forward = torch.compile(model.forward, dynamic=True)
    return model


COMPILE = False


def _positions(mask_BT: torch.Tensor) -> torch.Tensor:
    return (mask_BT.long().cumsum(-1) - 1).clamp(min=0)


def dpo(args: argparse.Namespace) -> dict[str, float]:
    from runner.data.arithmetic import problems
    from runner.models import read_model_type, resolve_model_path
    from runner.packers import build_packer
    from runner.types import ObsBundle

    path = resolve_model_path("builtin:tiny-arith")
    packer = build_packer(path, read_model_type(path))
    policy, reference = _load(path), _load(path)
    reference.eval()
    policy.train()
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=3e-4,
                            fused=True)
    n, beta = 16, 0.3
    steps = args.warmup + args.steps
    items = problems("train", n * steps)
    batches = []
    for s in range(steps):
        part = items[s * n:(s + 1) * n]
        both = [packer.get_preference_input(ObsBundle(p.question, id=str(i)), str(p.answer),
                                            str(p.answer + 1)) for i, p in enumerate(part)]
        inputs = [c for c, _ in both] + [r for _, r in both]
        batch = packer.collate(inputs)
        start = int(batch.loss_mask_BT[:, 1:].any(0).nonzero()[0])
        batches.append((batch.input_ids_BT, batch.attention_mask_BT,
                        batch.loss_mask_BT[:, 1 + start:].float(), start))
    times: dict[str, list[float]] = defaultdict(list)
    begin = time.perf_counter()
    for s, (ids, am, mask, start) in enumerate(batches):
        keep = ids.shape[1] - start
        t0 = time.perf_counter()
        with torch.no_grad():
            ref = (_shifted(reference(input_ids=ids, attention_mask=am, use_cache=False,
                                      logits_to_keep=keep).logits[:, :-1], ids, start)
                   * mask).sum(-1)
        t1 = time.perf_counter()
        lp_all = _shifted(policy(input_ids=ids, attention_mask=am, use_cache=False,
                                 logits_to_keep=keep).logits[:, :-1], ids, start)
        lp = (lp_all * mask).sum(-1)
        margin = beta * ((lp[:n] - ref[:n]) - (lp[n:] - ref[n:]))
        loss = -F.logsigmoid(margin).mean() - (lp[:n] / mask[:n].sum(-1)).mean()
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t4 = time.perf_counter()
        if s == args.warmup - 1:  # the warm-up's seconds (compilation with --compile)
            times["warmup"].append(time.perf_counter() - begin)
        if s >= args.warmup:
            for k, v in (("reference", t1 - t0), ("policy forward and loss", t2 - t1),
                         ("backward", t3 - t2), ("optimizer", t4 - t3), ("step", t4 - t0)):
                times[k].append(v)
    return {k: 1000 * statistics.median(v) for k, v in times.items()}


def opd(args: argparse.Namespace) -> dict[str, float]:
    from runner.data.arithmetic import problems
    from runner.models import read_model_type, resolve_model_path
    from runner.packers import build_packer
    from runner.types import ObsBundle

    path = resolve_model_path("builtin:tiny-arith")
    packer = build_packer(path, read_model_type(path))
    student = _load(path)
    teacher = _load(resolve_model_path("builtin:tiny-arith-teacher"))
    teacher.eval()
    student.train()
    opt = torch.optim.AdamW([p for p in student.parameters() if p.requires_grad], lr=1e-4,
                            fused=True)
    prompts, samples, new = 16, 2, 6
    pad, eos = packer.pad_token_id, packer.eos_token_id
    steps = args.warmup + args.steps
    items = problems("train", prompts * steps)
    batches = []
    for s in range(steps):
        rows = [list(packer.engine_prompt(packer.get_rollout_input(ObsBundle(p.question)))
                     .token_ids) for p in items[s * prompts:(s + 1) * prompts]
                for _ in range(samples)]
        width = max(map(len, rows))  # left-padded, as generate reads a batch
        ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
        am = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        batches.append((ids, am))
    torch.manual_seed(0)
    times: dict[str, list[float]] = defaultdict(list)
    begin = time.perf_counter()
    for s, (ids, am) in enumerate(batches):
        P = ids.shape[1]
        t0 = time.perf_counter()
        with torch.no_grad():
            seq = student.generate(input_ids=ids, attention_mask=am, do_sample=True,
                                   max_new_tokens=new, temperature=1.0, top_k=0, top_p=1.0,
                                   pad_token_id=pad, eos_token_id=eos)
        done = (seq[:, P:] == eos).long().cumsum(-1)
        comp = (done - (seq[:, P:] == eos).long()) == 0  # tokens up to and with the first EOS
        full_am = torch.cat([am, comp.long()], 1)
        pos = _positions(full_am)
        keep = seq.shape[1] - P + 1
        t1 = time.perf_counter()
        with torch.no_grad():
            t_logp = torch.log_softmax(teacher(input_ids=seq, attention_mask=full_am,
                                               position_ids=pos, use_cache=False,
                                               logits_to_keep=keep).logits[:, :-1].float(), -1)
        t2 = time.perf_counter()
        s_logp = torch.log_softmax(student(input_ids=seq, attention_mask=full_am,
                                           position_ids=pos, use_cache=False,
                                           logits_to_keep=keep).logits[:, :-1].float(), -1)
        kl = (s_logp.exp() * (s_logp - t_logp)).sum(-1)
        mask = comp.float()
        loss = (kl * mask).sum() / mask.sum().clamp(min=1)
        t3 = time.perf_counter()
        loss.backward()
        t4 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t5 = time.perf_counter()
        if s == args.warmup - 1:  # the warm-up's seconds (compilation with --compile)
            times["warmup"].append(time.perf_counter() - begin)
        if s >= args.warmup:
            for k, v in (("generate", t1 - t0), ("teacher", t2 - t1),
                         ("student forward and loss", t3 - t2), ("backward", t4 - t3),
                         ("optimizer", t5 - t4), ("step", t5 - t0)):
                times[k].append(v)
    return {k: 1000 * statistics.median(v) for k, v in times.items()}


def grpo(args: argparse.Namespace) -> dict[str, float]:
    from transformers import DynamicCache

    from runner.data.arithmetic import problems
    from runner.models import read_model_type, resolve_model_path
    from runner.packers import build_packer
    from runner.rewards.builtin import final_integer
    from runner.types import ObsBundle

    path = resolve_model_path("builtin:tiny-arith")
    packer = build_packer(path, read_model_type(path))
    policy = _load(path)
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=5e-5,
                            fused=True)
    prompts, group, new, minibatches, clip = 16, 8, 6, 2, 0.2
    pad, eos = packer.pad_token_id, packer.eos_token_id
    steps = args.warmup + args.steps
    items = problems("train", prompts * steps)
    batches = []
    for s in range(steps):
        part = items[s * prompts:(s + 1) * prompts]
        rows = [list(packer.engine_prompt(packer.get_rollout_input(ObsBundle(p.question)))
                     .token_ids) for p in part]
        width = max(map(len, rows))
        ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
        am = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        batches.append((ids, am, [p.answer for p in part]))
    torch.manual_seed(0)
    times: dict[str, list[float]] = defaultdict(list)
    index = torch.arange(prompts).repeat_interleave(group)
    begin = time.perf_counter()
    for s, (ids, am, answers) in enumerate(batches):
        P = ids.shape[1]
        t0 = time.perf_counter()
        policy.eval()
        with torch.no_grad():
            cache = DynamicCache(config=policy.config)
            policy(input_ids=ids[:, :-1], attention_mask=am[:, :-1],
                   position_ids=_positions(am[:, :-1]), past_key_values=cache, use_cache=True,
                   logits_to_keep=1)
            cache.reorder_cache(index)
            seq = policy.generate(input_ids=ids[index], attention_mask=am[index],
                                  past_key_values=cache, do_sample=True, max_new_tokens=new,
                                  temperature=1.0, top_k=0, top_p=1.0, pad_token_id=pad,
                                  eos_token_id=eos)
        policy.train()
        t1 = time.perf_counter()
        is_eos = (seq[:, P:] == eos).long()
        comp = (is_eos.cumsum(-1) - is_eos) == 0  # tokens up to and with the first EOS
        texts = packer.tokenizer.batch_decode(seq[:, P:], skip_special_tokens=True)
        reward = torch.tensor([float(final_integer(t) == answers[i // group])
                               for i, t in enumerate(texts)]).view(prompts, group)
        adv = ((reward - reward.mean(-1, keepdim=True))
               / (reward.std(-1, keepdim=True) + 1e-6)).view(-1, 1)
        full_am = torch.cat([am[index], comp.long()], 1)
        pos, keep, mask = _positions(full_am), seq.shape[1] - P + 1, comp.float()
        labels = seq[:, P:]
        per = len(seq) // minibatches
        with torch.no_grad():  # the later minibatches' old logprobs, before any update
            rest = slice(per, None)
            old_rest = torch.log_softmax(policy(
                input_ids=seq[rest], attention_mask=full_am[rest], position_ids=pos[rest],
                use_cache=False, logits_to_keep=keep).logits[:, :-1].float(), -1).gather(
                -1, labels[rest].unsqueeze(-1)).squeeze(-1)
        t2 = time.perf_counter()
        forward = backward = optimizer = 0.0
        for m in range(minibatches):
            r = slice(m * per, (m + 1) * per)
            u0 = time.perf_counter()
            lp = torch.log_softmax(policy(
                input_ids=seq[r], attention_mask=full_am[r], position_ids=pos[r],
                use_cache=False, logits_to_keep=keep).logits[:, :-1].float(), -1).gather(
                -1, labels[r].unsqueeze(-1)).squeeze(-1)
            old = lp.detach() if m == 0 else old_rest[(m - 1) * per:m * per]
            ratio = torch.exp(lp - old)
            surrogate = torch.minimum(ratio * adv[r], ratio.clamp(1 - clip, 1 + clip) * adv[r])
            loss = -(surrogate * mask[r]).sum() / mask[r].sum().clamp(min=1)
            u1 = time.perf_counter()
            loss.backward()
            u2 = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            u3 = time.perf_counter()
            forward, backward, optimizer = (forward + u1 - u0, backward + u2 - u1,
                                            optimizer + u3 - u2)
        t3 = time.perf_counter()
        if s == args.warmup - 1:  # the warm-up's seconds (compilation with --compile)
            times["warmup"].append(time.perf_counter() - begin)
        if s >= args.warmup:
            for k, v in (("rollout", t1 - t0), ("reward and old logprobs", t2 - t1),
                         ("forwards and losses", forward), ("backwards", backward),
                         ("optimizer", optimizer), ("step", t3 - t0)):
                times[k].append(v)
    return {k: 1000 * statistics.median(v) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("algo", choices=["grpo", "dpo", "opd"])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--compile", action="store_true",
                        help="compile every model's forward (torch.compile, dynamic shapes)")
    args = parser.parse_args()
    global COMPILE
    COMPILE = args.compile
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    ms = {"grpo": grpo, "dpo": dpo, "opd": opd}[args.algo](args)
    for k, v in ms.items():
        print(f"{k:>26}: {v:7.2f} ms" if k != "warmup" else f"{k:>26}: {v / 1000:7.1f} s")
    print(json.dumps({"algo": args.algo, "ms": ms}))


if __name__ == "__main__":
    main()
