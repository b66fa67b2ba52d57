"""What every built-in model build shares: a deterministic torch, quiet transformers progress, the
supervised warm-up loop with its progress bar, and a description of the CPU that built it.

A build is deterministic on one machine (fixed seed and data order, deterministic algorithms, one
thread). Another CPU's arithmetic (AVX2 against AVX-512 kernels) builds other last bits, which
training then amplifies: that is why the tiny models ship as files (``runner.models.builtin``)
and this code runs only when they are rebuilt on purpose.
"""

from __future__ import annotations

import contextlib
import platform
from collections.abc import Callable, Iterator

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

BUILD_THREADS = 1  # also avoids the oversubscription slowdown of two threads on a busy 2-core CPU


@contextlib.contextmanager
def deterministic_torch(threads: int = BUILD_THREADS) -> Iterator[None]:
    """Deterministic algorithms, ``threads`` threads and a forked RNG inside; the caller's after."""
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    was_threads = torch.get_num_threads()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(threads)
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        torch.use_deterministic_algorithms(was_deterministic)
        torch.set_num_threads(was_threads)


@contextlib.contextmanager
def quiet_transformers_progress() -> Iterator[None]:
    """No "Writing model shards" bar inside our own progress output."""
    from transformers.utils import logging

    was_enabled = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            logging.enable_progress_bar()


def warm_up_loop(model: torch.nn.Module, batch_of_step: Callable[[int], dict[str, torch.Tensor]],
                 steps: int, lr: float, label: str) -> list[float]:
    """Supervised warm-up: AdamW (no weight decay), 20 linear warm-up steps then linear decay to
    0, gradients clipped at 1; ``batch_of_step(step)`` gives each step's inputs with ``labels``.
    Returns the step losses; the model is left in eval mode."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / 20) * (1 - step / steps)
    )
    losses: list[float] = []
    model.train()
    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[loss]}"))
    console = Console(stderr=True)
    with Progress(*columns, TimeElapsedColumn(), console=console, transient=True) as bar:
        task = bar.add_task(f"warm-up {label}", total=steps, loss="")
        for step in range(steps):
            loss = model(**batch_of_step(step)).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            bar.update(task, advance=1, loss=f"loss {losses[-1]:.3f}")
    model.eval()
    return losses


def cpu_description() -> str:
    """The machine and the vector extensions that decide its float kernels, e.g.
    ``x86_64, AVX2, no AVX-512`` or ``x86_64, AVX-512, AVX-512 BF16``."""
    from runner.precision import cpu_bf16_flags, cpu_flags

    flags = cpu_flags()
    parts = [platform.machine() or "unknown"]
    if "avx512f" in flags:
        names = {"avx512_bf16": "AVX-512 BF16", "amx_bf16": "AMX"}
        parts += ["AVX-512", *(names[f] for f in cpu_bf16_flags())]
    elif "avx2" in flags:
        parts += ["AVX2", "no AVX-512"]
    return ", ".join(parts)
