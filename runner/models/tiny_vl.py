"""Build ``builtin:tiny-qwen3-vl``: a tiny Qwen3-VL (``Qwen3VLForConditionalGeneration``) made
offline and deterministically, with a supervised warm-up on the built-in image task.

The text model is 2 layers of hidden size 64 (head_dim 32: vLLM's CPU attention refuses 16;
``mrope_section`` sums to head_dim / 2), the vision tower 2 blocks of width 64 with 8-pixel
patches, so a 32x32 picture is 16 patches and 4 vision tokens after the 2x2 merge. The tokenizer
is the project's byte-level BPE (``runner.models.tokenizer_build``) plus Qwen's vision tokens
(``<|vision_start|>``, ``<|vision_end|>``, ``<|image_pad|>``, ``<|video_pad|>``); its chat
template renders list content with image and video parts as Qwen-VL's does. The folder holds
the processor's own files (image and video processor configs, the template), so
``AutoProcessor.from_pretrained(folder)`` loads a ``Qwen3VLProcessor``.

Warm-up: as for ``tiny-arith`` (see ``runner.models.tiny``), a random model never says a colour
right, and a perfectly warmed-up one leaves RL nothing to do; the warm-up answers a share
(``SLIP``) of the training pictures with the *next* colour of ``COLOURS``: a systematic habit
that an exact-match reward trains away, while sampling still finds the right colour.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from tokenizers import AddedToken

from runner.data import shapes as task
from runner.models.build_env import (
    cpu_description,
    deterministic_torch,
    quiet_transformers_progress,
    warm_up_loop,
)
from runner.models.tokenizer_build import build_tokenizer, save_tokenizer, tokenizer_config

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
MAX_POSITIONS = 1024
STEPS, BATCH, LR, SLIP, SEED = 600, 16, 3e-3, 0.6, 0
HELD_OUT_EVAL = 100
PATCH, MERGE, TEMPORAL = 8, 2, 2

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('roles must be system, user or assistant') }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'video' %}{{ '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
    "{{ eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def _tokenizer(folder: Path) -> Any:
    from transformers import PreTrainedTokenizerFast

    tok = build_tokenizer("bpe")
    # One token per colour name (the BPE was trained on arithmetic text), so an answer is one
    # token and eos, as the whole-number tokens are for tiny-arith.
    tok.add_tokens([AddedToken(c, normalized=False) for c in task.COLOURS])
    tok.add_special_tokens(list(VISION_TOKENS))
    save_tokenizer(tok, "bpe", folder)
    config = tokenizer_config("bpe")
    config.update(extra_special_tokens=[*config["extra_special_tokens"], *VISION_TOKENS],
                  chat_template=CHAT_TEMPLATE, model_max_length=MAX_POSITIONS)
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True)
                                                  + "\n", encoding="utf-8")
    return PreTrainedTokenizerFast.from_pretrained(folder)


def model_config(tokenizer: Any) -> Any:
    from transformers import Qwen3VLConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                max_position_embeddings=MAX_POSITIONS, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "mrope_section": [8, 4, 4], "mrope_interleaved": True},
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id, dtype="float32", tie_word_embeddings=True)
    vision = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, in_channels=3,
                  patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL,
                  out_hidden_size=64, num_position_embeddings=64, deepstack_visual_indexes=[1])
    return Qwen3VLConfig(text_config=text, vision_config=vision,
                         image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                         vision_start_token_id=ids["<|vision_start|>"],
                         vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=True,
                         dtype="float32")


def processor_for(tokenizer: Any) -> Any:
    """The Qwen3-VL processor of the tiny model: pictures resized to multiples of 16 pixels
    between 16x16 and 64x64 (1 to 16 vision tokens), video frames likewise, at most 8 frames."""
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

    factor = PATCH * MERGE
    image = Qwen2VLImageProcessor(patch_size=PATCH, temporal_patch_size=TEMPORAL,
                                  merge_size=MERGE,
                                  size={"shortest_edge": factor * factor,
                                        "longest_edge": 64 * 64})
    video = Qwen3VLVideoProcessor(patch_size=PATCH, temporal_patch_size=TEMPORAL,
                                  merge_size=MERGE,
                                  size={"shortest_edge": factor * factor,
                                        "longest_edge": 8 * 64 * 64},
                                  fps=2.0, min_frames=2, max_frames=8, cap_pixels_per_frame=True)
    return Qwen3VLProcessor(image_processor=image, tokenizer=tokenizer, video_processor=video,
                            chat_template=CHAT_TEMPLATE)


def messages_for(question: str, n_images: int = 1, n_videos: int = 0) -> list[dict[str, Any]]:
    parts = [{"type": "image"}] * n_images + [{"type": "video"}] * n_videos
    return [{"role": "user", "content": [*parts, {"type": "text", "text": question}]}]


def _slipped(colour: str) -> str:
    names = list(task.COLOURS)
    return names[(names.index(colour) + 1) % len(names)]


def warm_up_batch(processor: Any, items: Sequence[task.Shape], answers: Sequence[str]
                  ) -> dict[str, torch.Tensor]:
    tok = processor.tokenizer
    prompt = tok.apply_chat_template(messages_for(task.QUESTION), tokenize=False,
                                     add_generation_prompt=True)
    texts = [prompt + a + tok.eos_token for a in answers]
    enc = processor(text=texts, images=[s.image() for s in items], return_tensors="pt",
                    padding=True, padding_side="right")
    n_prompt = len(processor(text=[prompt], images=[items[0].image()])["input_ids"][0])
    labels = enc["input_ids"].clone()
    labels[:, :n_prompt] = -100
    labels[enc["attention_mask"] == 0] = -100
    return {**enc, "labels": labels}


@torch.no_grad()
def held_out_accuracy(model: Any, processor: Any, count: int = HELD_OUT_EVAL,
                      temperature: float = 0.0) -> float:
    """Accuracy (exact colour name) on the first ``count`` held-out pictures: greedy, or
    sampled at ``temperature`` (seed 0)."""
    tok = processor.tokenizer
    items = task.shapes("held_out", count)
    prompt = tok.apply_chat_template(messages_for(task.QUESTION), tokenize=False,
                                     add_generation_prompt=True)
    enc = processor(text=[prompt] * len(items), images=[s.image() for s in items],
                    return_tensors="pt", padding=True, padding_side="left")
    sample = {"do_sample": True, "temperature": temperature, "top_k": 0} if temperature else {
        "do_sample": False}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        out = model.generate(**enc, max_new_tokens=4, pad_token_id=tok.pad_token_id,
                             eos_token_id=tok.eos_token_id, **sample)
    texts = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    return sum(t.strip() == s.colour for t, s in zip(texts, items, strict=True)) / len(items)


def build_tiny_vl(folder: Path, name: str) -> dict[str, object]:
    """Write the complete model folder into ``folder``; returns its build info."""
    from transformers import GenerationConfig, Qwen3VLForConditionalGeneration

    console = Console(stderr=True)
    console.print(f"building builtin:{name} ...")
    with deterministic_torch():
        tokenizer = _tokenizer(folder)
        processor = processor_for(tokenizer)
        torch.manual_seed(SEED)
        model = Qwen3VLForConditionalGeneration(model_config(tokenizer))
        train = task.shapes("train", STEPS * BATCH, SEED)
        rng = random.Random(f"slip-{SEED}")
        answers = [_slipped(s.colour) if rng.random() < SLIP else s.colour for s in train]
        losses = warm_up_loop(
            model,
            lambda step: warm_up_batch(processor, train[step * BATCH : (step + 1) * BATCH],
                                       answers[step * BATCH : (step + 1) * BATCH]),
            STEPS, LR, name)
        greedy = held_out_accuracy(model, processor)
        sampled = held_out_accuracy(model, processor, temperature=1.0)
        model.generation_config = GenerationConfig(
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id, do_sample=False, max_new_tokens=8)
        with quiet_transformers_progress():
            model.save_pretrained(folder)
            processor.save_pretrained(folder)
    console.print(f"built builtin:{name}: held-out greedy accuracy {greedy:.3f}")
    return {
        "name": name,
        "warm_up": {"steps": STEPS, "batch_size": BATCH, "lr": LR, "slip": SLIP, "seed": SEED},
        "parameters": sum(p.numel() for p in model.parameters()),
        "final_loss": round(sum(losses[-20:]) / len(losses[-20:]), 4),
        "held_out_count": HELD_OUT_EVAL,
        "held_out_greedy_accuracy": greedy,
        "held_out_sampled_accuracy": sampled,  # temperature 1.0, seed 0
        "torch_version": torch.__version__,
        "cpu": cpu_description(),
    }
