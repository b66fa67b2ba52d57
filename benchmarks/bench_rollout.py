"""Rollout throughput of the engines, the time of one weight update, and peak RSS.

Workload (default): 64 prompts x 8 samples x 32 new tokens (min_tokens not forced: a completion
may stop early at EOS, so tokens/s counts the tokens actually generated).

Run: ``.venv/bin/python benchmarks/bench_rollout.py --engine hf --model builtin:tiny-arith``
(``--engine vllm``, ``--model builtin:smollm2-135m-instruct``). One engine per process so the
peak RSS is that engine's. Prints a markdown table row.
"""

from __future__ import annotations

import argparse
import resource
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine", choices=["hf", "vllm"], default="hf")
    parser.add_argument("--model", default="builtin:tiny-arith")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=128,
                        help="sequences per generate call (hf)")
    parser.add_argument("--media", choices=["none", "image", "video"], default="none",
                        help="prompts of the built-in image task (a 32x32 picture each) or "
                        "one 6-frame video each (a vision-language --model)")
    args = parser.parse_args()

    from runner.data.arithmetic import problems
    from runner.models import load_causal_lm, read_model_type, resolve_model_path
    from runner.packers import build_packer
    from runner.rollout.base import SamplingConfig
    from runner.types import ObsBundle
    from runner.ui.quiet import quiet_libraries

    quiet_libraries()
    path = resolve_model_path(args.model)
    packer = build_packer(path, read_model_type(path))
    items = media_items(args.media, args.prompts) if args.media != "none" else [
        ObsBundle(p.question, str(p.answer)) for p in problems("train", args.prompts)]
    prompts = [packer.engine_prompt(packer.get_rollout_input(i)) for i in items]
    start = time.perf_counter()
    if args.engine == "vllm":
        from runner.rollout.vllm import VLLMEngine

        engine = VLLMEngine(str(path), max_model_len=512)
    else:
        from runner.rollout.hf import HFEngine

        engine = HFEngine.from_path(str(path), batch_size=args.batch_size)
    startup = time.perf_counter() - start
    params = SamplingConfig(n=args.samples, max_new_tokens=args.tokens, temperature=1.0, seed=0)
    engine.generate(prompts[:4], params)  # warm-up
    times, tokens = [], 0
    for seed in range(3):
        t = time.perf_counter()
        outs = engine.generate(prompts, SamplingConfig(n=args.samples, max_new_tokens=args.tokens,
                                                       temperature=1.0, seed=seed))
        times.append(time.perf_counter() - t)
        tokens = sum(len(c.token_ids) for o in outs for c in o.completions)
    policy = load_causal_lm(path)
    t = time.perf_counter()
    engine.update_weights(policy.named_parameters())
    update = time.perf_counter() - t
    best = min(times)
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    media = "" if args.media == "none" else f" ({args.media})"
    print(f"| {args.engine} | {args.model}{media} | {args.prompts}x{args.samples}x{args.tokens} | "
          f"{tokens} | {best:.2f} | {tokens / best:.0f} | {update:.3f} | {startup:.1f} | "
          f"{rss_mb:.0f} |")


def media_items(kind: str, n: int) -> list:
    """``n`` prompts of the image task, with its picture or with a 6-frame video of it."""
    import io

    import av
    import numpy as np

    from runner.data.shapes import QUESTION, shapes
    from runner.types import ObsBundle

    out = []
    for s in shapes("train", n):
        if kind == "image":
            out.append(ObsBundle(QUESTION, s.colour, images=(s.png(),)))
            continue
        buf = io.BytesIO()
        with av.open(buf, "w", format="mp4") as container:
            stream = container.add_stream("mpeg4", rate=4)
            stream.width = stream.height = 32
            stream.pix_fmt = "yuv420p"
            frame = np.asarray(s.image(), dtype=np.uint8)
            for _ in range(6):
                for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                    container.mux(packet)
            for packet in stream.encode():
                container.mux(packet)
        out.append(ObsBundle(QUESTION, s.colour, videos=(buf.getvalue(),)))
    return out


if __name__ == "__main__":
    main()
