"""Qwen3VLDataPacker: prompts with images and videos, through the model's own ``AutoProcessor``.

Rollout side: ``get_rollout_input`` decodes the item's media (``runner.data.media``) and renders
the chat template with one image / video part per medium before the prompt text.
``engine_prompt`` turns that into what both engines need: the *unexpanded* ids (one
``<|image_pad|>`` per image) with ``multi_modal_data`` for vLLM, which runs the processor and
expands the placeholders itself (expanded ids sent to it would be expanded again: a wrong
prompt), and the processor's expanded ids and tensors for the hf engine. A video goes as its
sampled frames with their fps and frame indices always (both engines' processors place frame
timestamps from them; ``do_sample_frames`` is off so neither re-samples).

Policy side: the processor's expanded ids, then the completion; ``token_extra`` carries
``mm_token_type_ids`` (0 on completion positions), ``extra`` the item's ``pixel_values`` /
``image_grid_thw`` and ``pixel_values_videos`` / ``video_grid_thw``; ``collate`` pads them and
leaves ``position_ids`` out: Qwen3-VL computes its 3-D M-RoPE positions from the ids, the
grids and ``mm_token_type_ids``, and 1-D positions passed to it would silently shift its
logits. Padding-free packing is refused. Decoding, offsets and DPO answers are the
decoder-only packer's (the tokenizer is the processor's).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import attrs

from runner.data.media import VideoClip, decode_media
from runner.packers.base import EnginePrompt, PolicyBatch, RLPolicyInput
from runner.packers.chat import NotAppendOnly, render_conversation
from runner.packers.decoder_only import DecoderOnlyLLMDataPacker
from runner.types import ObsBundle

# second_per_grid_ts: Qwen2.5-VL's seconds per temporal patch of each video.
ROW_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw",
            "second_per_grid_ts")
TOKEN_KEYS = ("mm_token_type_ids",)
MEMO_SIZE = 512  # processed prompts kept (one per distinct item of recent batches)


@attrs.frozen(eq=False)
class VLRolloutInput:
    """A rendered prompt and its decoded media (PIL images, ``VideoClip`` s)."""

    text: str
    images: tuple[Any, ...] = ()
    videos: tuple[VideoClip, ...] = ()


class Qwen3VLDataPacker(DecoderOnlyLLMDataPacker):
    """The built-in packer for Qwen3-VL models (``model_type`` ``qwen3_vl``), and for Qwen2-VL
    and Qwen2.5-VL, whose processors follow the same contract (tested on images)."""

    renders_chat = False  # its prompts carry images and videos: no [env] episodes yet

    # Not padding-free: the model needs each row's mm_token_type_ids, grids and pixel values to
    # place its 3-D positions, which packed rows with restarting 1-D positions cannot give.
    can_pack = False

    def __init__(self) -> None:
        super().__init__()
        self.processor: Any = None
        self._memo: OrderedDict[int, tuple[Any, Any]] = OrderedDict()

    def setup(self, model_path: str) -> None:
        from transformers import AutoProcessor

        self.model_path = str(model_path)
        processor = AutoProcessor.from_pretrained(
            str(model_path), trust_remote_code=self.model_options.trust_remote_code)
        if getattr(processor, "image_processor", None) is None:
            raise ValueError(f"{model_path}: AutoProcessor finds no image processor there (a "
                             f"{type(processor).__name__}): not a vision-language model folder")
        self.processor = processor
        self.tokenizer = processor.tokenizer
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = pad if pad is not None else self.tokenizer.eos_token_id

    # --- rollout side ---------------------------------------------------------------------
    def messages(self, item: ObsBundle) -> list[dict[str, Any]]:
        """The chat of ``item``: given messages as they are, else one user turn holding an
        image part per image, a video part per video, then the prompt text."""
        if isinstance(item.prompt, list):
            return item.prompt
        parts = ([{"type": "image"}] * len(item.images) + [{"type": "video"}] * len(item.videos)
                 + [{"type": "text", "text": str(item.prompt)}])
        return [{"role": "user", "content": parts}]

    def get_rollout_input(self, item: ObsBundle) -> VLRolloutInput:
        self._tok()
        text = self.processor.apply_chat_template(self.messages(item), tokenize=False,
                                                  add_generation_prompt=True)
        return VLRolloutInput(text, *decode_media(item))

    def process(self, rollout_input: VLRolloutInput) -> Any:
        """The processor's output for one prompt (``input_ids`` [1, T], ``mm_token_type_ids``,
        pixel values and grids), computed once per rollout input."""
        key = id(rollout_input)
        hit = self._memo.get(key)
        if hit is not None and hit[0] is rollout_input:
            return hit[1]
        kwargs: dict[str, Any] = {}
        if rollout_input.images:
            kwargs["images"] = list(rollout_input.images)
        if rollout_input.videos:
            kwargs.update(videos=[v.frames for v in rollout_input.videos],
                          video_metadata=[v.metadata() for v in rollout_input.videos],
                          do_sample_frames=False)
        out = self.processor(text=[rollout_input.text], return_tensors="pt", **kwargs)
        self._memo[key] = (rollout_input, out)
        while len(self._memo) > MEMO_SIZE:
            self._memo.popitem(last=False)
        return out

    def encode_rollout_input(self, rollout_input: Any) -> list[int]:
        """The processor's expanded ids (a text prompt: the tokenizer's ids, as the base)."""
        if not isinstance(rollout_input, VLRolloutInput):
            return super().encode_rollout_input(rollout_input)
        return [int(t) for t in self.process(rollout_input)["input_ids"][0]]

    def engine_prompt(self, rollout_input: Any) -> EnginePrompt:
        if not isinstance(rollout_input, VLRolloutInput):
            return super().engine_prompt(rollout_input)
        out = self.process(rollout_input)
        unexpanded = self._tok()(rollout_input.text, add_special_tokens=False)["input_ids"]
        media: dict[str, Any] = {}
        if rollout_input.images:
            media["image"] = list(rollout_input.images)
        if rollout_input.videos:
            media["video"] = [(v.frames, v.metadata()) for v in rollout_input.videos]
        return EnginePrompt(
            tuple(int(t) for t in unexpanded), tuple(int(t) for t in out["input_ids"][0]),
            hf_inputs={k: out[k] for k in ROW_KEYS if k in out},
            hf_token_inputs={k: tuple(int(t) for t in out[k][0]) for k in TOKEN_KEYS if k in out},
            multi_modal_data=media,
            mm_processor_kwargs={"do_sample_frames": False} if rollout_input.videos else {})

    def describe_rollout_input(self, rollout_input: Any) -> list[tuple[str, str]]:
        if not isinstance(rollout_input, VLRolloutInput):
            return super().describe_rollout_input(rollout_input)
        prompt = self.engine_prompt(rollout_input)
        out = self.process(rollout_input)
        rows = [("rollout input", repr(rollout_input.text)),
                ("media", f"{len(rollout_input.images)} image(s) "
                 + " ".join(f"{im.width}x{im.height}" for im in rollout_input.images)
                 + f", {len(rollout_input.videos)} video(s) "
                 + " ".join(f"{v.frames.shape[0]} frames at {v.fps:g} fps"
                            for v in rollout_input.videos))]
        for key in ("image_grid_thw", "video_grid_thw"):
            if key in out:
                rows.append((key, str(out[key].tolist())))
        n_vision = int((out["mm_token_type_ids"][0] > 0).sum()) if "mm_token_type_ids" in out else 0
        rows += [("prompt tokens", f"{len(prompt.full_ids)} for the policy and the hf engine "
                  f"({n_vision} vision tokens), {len(prompt.token_ids)} unexpanded for vLLM"),
                 ("model inputs", ", ".join(
                     [f"{k} {tuple(v.shape)}" for k, v in prompt.hf_inputs.items()]
                     + [f"{k} ({len(v)},)" for k, v in prompt.hf_token_inputs.items()]))]
        return rows

    # --- policy side ----------------------------------------------------------------------
    def get_policy_input(
        self,
        sample: ObsBundle,
        rollout_output: Any,
        n_ignore_prefix_tokens: int = 0,
        *,
        prompt_ids: Sequence[int] | None = None,
    ) -> RLPolicyInput:
        """The expanded prompt, then the completion; ``prompt_ids`` (what the engine
        returned), when given, must be this prompt's unexpanded or expanded ids."""
        rollout_input = self._rollout_input_of(sample)
        prompt = self.engine_prompt(rollout_input)
        if prompt_ids is not None and tuple(int(t) for t in prompt_ids) not in (
                prompt.token_ids, prompt.full_ids):
            raise ValueError("the engine's prompt ids differ from this packer's for the same "
                             "item: the rollout and policy packers must come from one factory")
        out = self.process(rollout_input)
        completion = self._completion_ids(rollout_output)
        ids = prompt.full_ids + completion
        n_prompt = len(prompt.full_ids)
        mask = (0,) * n_prompt + tuple(0 if i < n_ignore_prefix_tokens else 1
                                       for i in range(len(completion)))
        token_extra = {k: tuple(int(t) for t in out[k][0]) + (0,) * len(completion)
                       for k in TOKEN_KEYS if k in out}
        extra = {k: out[k] for k in ROW_KEYS if k in out}
        return RLPolicyInput(ids, mask, n_prompt, extra=extra, token_extra=token_extra)

    def get_conversation_input(self, messages: list[dict[str, Any]], loss_on: str = "assistant",
                               tools: list[dict[str, Any]] | None = None,
                               images: Sequence[Any] = ()) -> RLPolicyInput:
        """SFT of a conversation with images (one per ``{"type": "image"}`` part of its
        messages): the processor's chat template renders it prefix by prefix (the text rule of
        the base class, on the template's unexpanded ids: one ``<|image_pad|>`` per image),
        then the processor expands each image's placeholder into its vision tokens, none of
        them trained; ``extra`` and ``token_extra`` carry the pixel values, grids and
        ``mm_token_type_ids`` as the policy side of a rollout does."""
        tok = self._tok()

        def render(msgs: list[dict[str, Any]], generation: bool) -> list[int]:
            text = self.processor.apply_chat_template(msgs, tools=tools or None, tokenize=False,
                                                      add_generation_prompt=generation)
            return list(tok(text, add_special_tokens=False)["input_ids"])

        out = render_conversation(render, self.eos_token_id, messages, loss_on)
        last = max(n for n, m in enumerate(messages) if m.get("role") == "assistant")
        text = self.processor.apply_chat_template(messages[:last + 1], tools=tools or None,
                                                  tokenize=False)
        if list(tok(text, add_special_tokens=False)["input_ids"]) != list(out.ids):
            raise NotAppendOnly("the whole conversation renders to other tokens than its "
                                "turns one by one")
        kwargs = {"images": list(images)} if images else {}
        processed = self.processor(text=[text], return_tensors="pt", **kwargs)
        expanded = [int(t) for t in processed["input_ids"][0]]
        ids, mask = _expanded_mask(list(out.ids), list(out.mask), expanded,
                                   tok.convert_tokens_to_ids(self.processor.image_token))
        first = next((i for i, m in enumerate(mask) if m), len(mask))
        token_extra = {k: tuple(int(t) for t in processed[k][0]) for k in TOKEN_KEYS
                       if k in processed}
        extra = {k: processed[k] for k in ROW_KEYS if k in processed}
        return RLPolicyInput(tuple(ids), tuple(mask), first, extra=extra,
                             token_extra=token_extra)

    def collate(self, inputs: Sequence[RLPolicyInput], *, packed: bool = False) -> PolicyBatch:
        if packed:
            raise ValueError("Qwen3VLDataPacker: padding-free packing is not supported (Qwen3-VL "
                             "computes 3-D positions per padded row from mm_token_type_ids and "
                             "the grids); collate padded batches")
        return attrs.evolve(super().collate(inputs), position_ids_BT=None)

    def _rollout_input_of(self, sample: ObsBundle) -> VLRolloutInput:
        """The rollout input of ``sample``, built once per item object (every completion of a
        prompt shares its item)."""
        key = -id(sample) - 1  # negative: apart from the processed-prompt entries
        hit = self._memo.get(key)
        if hit is not None and hit[0] is sample:
            return hit[1]
        rollout_input = self.get_rollout_input(sample)
        self._memo[key] = (sample, rollout_input)
        return rollout_input


def _expanded_mask(ids: list[int], mask: list[int], expanded: list[int], pad_id: int
                   ) -> tuple[list[int], list[int]]:
    """``expanded`` (the processor's ids of ``ids``' text: each image placeholder ``pad_id``
    repeated as many times as the image has vision tokens) with ``mask`` carried over, 0 on
    every vision token. Any other difference between the two is an error: the trained tokens
    must be the template's.

    >>> _expanded_mask([5, 9, 6, 7], [0, 0, 1, 1], [5, 9, 9, 9, 6, 7], 9)
    ([5, 9, 9, 9, 6, 7], [0, 0, 0, 0, 1, 1])
    """
    out: list[int] = []
    j = 0
    for i, (token, trained) in enumerate(zip(ids, mask, strict=True)):
        if token == pad_id:
            k = j
            while k < len(expanded) and expanded[k] == pad_id:
                k += 1
            if trained or k == j:
                raise ValueError(f"token {i}: an image placeholder the processor does not "
                                 "expand, or one in an assistant turn")
            out += [0] * (k - j)
            j = k
            continue
        if j >= len(expanded) or expanded[j] != token:
            raise ValueError(f"token {i}: the processor's ids differ from the chat template's")
        out.append(trained)
        j += 1
    if j != len(expanded):
        raise ValueError("the processor's ids run past the chat template's")
    return expanded, out
