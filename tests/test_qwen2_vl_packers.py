"""Qwen3VLDataPacker serves Qwen2-VL and Qwen2.5-VL folders too (the registry maps ``qwen2_vl``
and ``qwen2_5_vl`` to it): for a tiny random model of each, built here with the tiny Qwen3-VL's
tokenizer, the packer's ids, ``mm_token_type_ids`` and grids equal the processor's own output for
an image, and the hf engine's sampled-token logprobs equal the policy's."""

from __future__ import annotations

import pytest
import torch

from runner.data.shapes import QUESTION, shapes
from runner.rollout.base import SamplingConfig
from runner.types import ObsBundle


def build_folder(kind: str, folder, vl_path) -> None:
    import transformers as tf

    from runner.models.tiny_vl import CHAT_TEMPLATE, MERGE, PATCH

    tok = tf.AutoProcessor.from_pretrained(str(vl_path)).tokenizer
    ids = {t: tok.convert_tokens_to_ids(t) for t in
           ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")}
    text = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "mrope_section": [8, 4, 4]},
                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id, tie_word_embeddings=True)
    if kind == "qwen2_vl":
        vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, patch_size=PATCH,
                      spatial_merge_size=MERGE, temporal_patch_size=2)
        config_cls, model_cls, proc_cls = (tf.Qwen2VLConfig, tf.Qwen2VLForConditionalGeneration,
                                           tf.Qwen2VLProcessor)
    else:
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                      patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=2,
                      out_hidden_size=64, window_size=32, fullatt_block_indexes=[1])
        config_cls, model_cls, proc_cls = (tf.Qwen2_5_VLConfig,
                                           tf.Qwen2_5_VLForConditionalGeneration,
                                           tf.Qwen2_5_VLProcessor)
    config = config_cls(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                        video_token_id=ids["<|video_pad|>"],
                        vision_start_token_id=ids["<|vision_start|>"],
                        vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=True)
    torch.manual_seed(0)
    model_cls(config).save_pretrained(folder)
    size = {"shortest_edge": 256, "longest_edge": 4096}
    proc_cls(image_processor=tf.Qwen2VLImageProcessor(patch_size=PATCH, merge_size=MERGE,
                                                      size=size),
             tokenizer=tok,
             video_processor=tf.Qwen2VLVideoProcessor(patch_size=PATCH, merge_size=MERGE,
                                                      size=size),
             chat_template=CHAT_TEMPLATE).save_pretrained(folder)


@pytest.fixture(scope="module")
def vl_path():
    from runner.models import resolve_model_path

    return resolve_model_path("builtin:tiny-qwen3-vl")


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl"])
def test_the_qwen3_vl_packer_serves_older_qwen_vl_models(kind, tmp_path, vl_path):
    from transformers import AutoProcessor

    from runner.data.media import load_image
    from runner.models import load_causal_lm, read_model_type
    from runner.packers import Qwen3VLDataPacker, build_packer
    from runner.rollout.hf import HFEngine
    from runner.train.loops.rollouts import trajectory
    from runner.train.roles.policy import batch_logprobs, completion_grid

    build_folder(kind, tmp_path, vl_path)
    assert read_model_type(tmp_path) == kind
    packer = build_packer(tmp_path, kind)
    assert type(packer) is Qwen3VLDataPacker
    processor = AutoProcessor.from_pretrained(str(tmp_path))
    items = [ObsBundle(QUESTION, s.colour, images=(s.png(),)) for s in shapes("held_out", 2)]
    image = load_image(items[0].images[0])
    ref = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image", "image": image},
                                      {"type": "text", "text": QUESTION}]}],
        tokenize=True, return_dict=True, add_generation_prompt=True, return_tensors="pt")
    prompt = packer.engine_prompt(packer.get_rollout_input(items[0]))
    assert prompt.full_ids == tuple(ref["input_ids"][0].tolist())
    assert (prompt.hf_token_inputs["mm_token_type_ids"]
            == tuple(ref["mm_token_type_ids"][0].tolist()))
    assert torch.equal(prompt.hf_inputs["image_grid_thw"], ref["image_grid_thw"])

    model = load_causal_lm(tmp_path)
    engine = HFEngine(model, packer.tokenizer)
    prompts = [packer.engine_prompt(packer.get_rollout_input(i)) for i in items]
    traj = trajectory(items, engine.generate(prompts,
                                             SamplingConfig(n=2, max_new_tokens=4, seed=1)))
    inputs = traj.policy_inputs(packer)
    with torch.no_grad():
        lp_BT, mask_BT = batch_logprobs(model, packer.collate(inputs))
    engine_BT = completion_grid(inputs, [c.logprobs for c in traj.completions], lp_BT.shape[1])
    assert mask_BT.sum() >= 4
    assert float(((lp_BT - engine_BT).abs() * mask_BT).max()) < 1e-5
