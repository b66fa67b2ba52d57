"""The multimodal path on builtin:tiny-qwen3-vl: Qwen3VLDataPacker against the processor's own
output, the hf engine and the policy on image and video prompts, bad media, and the contract
pieces multimodal needs (extras carried and selected, no 1-D positions, no packing).

vLLM (marker ``vllm``) and the training runs (marker ``slow``) are in test_qwen3_vl_runs.py.
"""

from __future__ import annotations

import pytest
import torch

from runner.data.shapes import QUESTION, shapes
from runner.errors import RecipeError
from runner.rollout.base import SamplingConfig
from runner.types import ObsBundle
from tests.extmods.vl import make_video


@pytest.fixture(scope="module")
def vl_path():
    from runner.models import resolve_model_path

    return resolve_model_path("builtin:tiny-qwen3-vl")


@pytest.fixture(scope="module")
def packer(vl_path):
    from runner.packers import build_packer

    return build_packer(vl_path, "qwen3_vl")


@pytest.fixture(scope="module")
def processor(vl_path):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(vl_path))


@pytest.fixture(scope="module")
def model(vl_path):
    from runner.models import load_causal_lm

    return load_causal_lm(vl_path)


@pytest.fixture(scope="module")
def video():
    return make_video()


@pytest.fixture(scope="module")
def items(video):
    """Two pictures (32 px: 4 vision tokens), one 48x64 picture (12), a video, a text prompt."""
    from PIL import Image

    pics = shapes("held_out", 2)
    big = Image.new("RGB", (64, 48), (10, 10, 10))
    return [ObsBundle(QUESTION, p.colour, images=(p.png(),)) for p in pics] + [
        ObsBundle(QUESTION, "", images=(big,)),
        ObsBundle(QUESTION, "red", videos=(video,)),
        ObsBundle("Say a colour.", "")]


def test_packer_ids_and_inputs_equal_the_processors_own(packer, processor, items, video):
    from runner.data.media import load_video

    tok = processor.tokenizer
    image_pad, video_pad = (tok.convert_tokens_to_ids(t)
                            for t in ("<|image_pad|>", "<|video_pad|>"))
    for item in items[:3]:  # images: the processor's whole chat pipeline, media in the messages
        from runner.data.media import load_image

        image = load_image(item.images[0])
        messages = [{"role": "user", "content": [{"type": "image", "image": image},
                                                 {"type": "text", "text": QUESTION}]}]
        ref = processor.apply_chat_template(messages, tokenize=True, return_dict=True,
                                            add_generation_prompt=True, return_tensors="pt")
        prompt = packer.engine_prompt(packer.get_rollout_input(item))
        assert prompt.full_ids == tuple(ref["input_ids"][0].tolist())
        assert (prompt.hf_token_inputs["mm_token_type_ids"]
                == tuple(ref["mm_token_type_ids"][0].tolist()))
        assert torch.equal(prompt.hf_inputs["image_grid_thw"], ref["image_grid_thw"])
        assert torch.equal(prompt.hf_inputs["pixel_values"], ref["pixel_values"])
        n_vision = int(ref["image_grid_thw"].prod()) // 4
        assert prompt.full_ids.count(image_pad) == n_vision
        # vLLM's ids: the rendered text's, one placeholder per image (vLLM expands it)
        assert prompt.token_ids.count(image_pad) == 1
        assert len(prompt.full_ids) - len(prompt.token_ids) == n_vision - 1
    assert [packer.engine_prompt(packer.get_rollout_input(i)).hf_inputs["image_grid_thw"].tolist()
            for i in items[:3]] == [[[1, 4, 4]], [[1, 4, 4]], [[1, 6, 8]]]

    # Video: decoded with PyAV, every frame kept (6 < 8), its fps and indices passed on.
    clip = load_video(video)
    assert clip.frames.shape == (6, 32, 32, 3) and clip.fps == 4.0
    assert clip.frames_indices == tuple(range(6))
    text = tok.apply_chat_template(
        [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": QUESTION}]}],
        tokenize=False, add_generation_prompt=True)
    ref = processor(text=[text], videos=[clip.frames], video_metadata=[clip.metadata()],
                    do_sample_frames=False, return_tensors="pt")
    prompt = packer.engine_prompt(packer.get_rollout_input(items[3]))
    assert prompt.full_ids == tuple(ref["input_ids"][0].tolist())
    assert (prompt.hf_token_inputs["mm_token_type_ids"]
            == tuple(ref["mm_token_type_ids"][0].tolist()))
    assert ref["video_grid_thw"].tolist() == [[3, 4, 4]]  # 6 frames, 2 per temporal patch
    assert torch.equal(prompt.hf_inputs["pixel_values_videos"], ref["pixel_values_videos"])
    assert prompt.full_ids.count(video_pad) == 3 * 4 and prompt.token_ids.count(video_pad) == 1
    # frame timestamps from the metadata: frames (0, 1), (2, 3), (4, 5) at 4 fps
    decoded = packer.decode(prompt.full_ids, skip_special_tokens=False)
    assert "<0.1 seconds>" in decoded and "<0.6 seconds>" in decoded and "<1.1 seconds>" in decoded
    frames, metadata = prompt.multi_modal_data["video"][0]
    assert metadata["fps"] == 4.0 and metadata["frames_indices"] == list(range(6))
    assert prompt.mm_processor_kwargs == {"do_sample_frames": False}


def test_hf_rollout_and_policy_agree_on_every_token(packer, vl_path, model, items):
    from runner.rollout.hf import HFEngine
    from runner.train.loops.rollouts import trajectory
    from runner.train.roles.policy import batch_logprobs, completion_grid

    engine = HFEngine(model, packer.tokenizer)
    prompts = [packer.engine_prompt(packer.get_rollout_input(i)) for i in items]
    outputs = engine.generate(prompts, SamplingConfig(n=2, max_new_tokens=4, seed=5))
    assert [o.prompt_ids for o in outputs] == [p.token_ids for p in prompts]
    traj = trajectory(items, outputs)
    inputs = traj.policy_inputs(packer)
    for x, p in zip(inputs, [p for p in prompts for _ in range(2)], strict=True):
        assert x.input_ids[:x.n_prompt_tokens] == p.full_ids  # the policy sees the expanded prompt
        assert (x.token_extra["mm_token_type_ids"][x.n_prompt_tokens:]
                == (0,) * len(x.completion_ids))
    batch = packer.collate(inputs)
    assert batch.position_ids_BT is None  # Qwen3-VL makes its own 3-D positions
    with torch.no_grad():
        lp_BT, mask_BT = batch_logprobs(model, batch)
    engine_BT = completion_grid(inputs, [c.logprobs for c in traj.completions], lp_BT.shape[1])
    assert mask_BT.sum() > 10
    assert float(((lp_BT - engine_BT).abs() * mask_BT).max()) < 1e-5
    # A subset of rows carries exactly its rows' images and videos.
    rows = torch.tensor([5, 6, 8])
    sub = batch.select(rows)
    assert sub.extras.model_kwargs()["pixel_values"].shape[0] == 48  # one 48x64 picture
    assert "pixel_values_videos" not in batch.select(torch.tensor([0, 9])).extras.model_kwargs()
    with torch.no_grad():
        sub_BT, sub_mask = batch_logprobs(model, sub)
    assert torch.equal(sub_mask, mask_BT[rows, :sub_BT.shape[1]])
    assert float(((sub_BT - lp_BT[rows, :sub_BT.shape[1]]).abs() * sub_mask).max()) < 1e-5
    # Why no position_ids: 1-D positions passed to Qwen3-VL shift its logits.
    with torch.no_grad():
        shifted = model(input_ids=batch.input_ids_BT, use_cache=False,
                        position_ids=(batch.attention_mask_BT.cumsum(-1) - 1).clamp(min=0),
                        **{k: v for k, v in batch.model_kwargs().items()
                           if k != "position_ids"}).logits
        right = model(input_ids=batch.input_ids_BT, use_cache=False, **batch.model_kwargs()).logits
    assert float((shifted - right)[:8].abs().max()) > 1e-3
    with pytest.raises(ValueError, match="padding-free packing is not supported"):
        packer.collate(inputs, packed=True)


def test_teacher_input_holds_the_items_image(packer, items):
    from runner.rollout.base import Completion

    x = packer.get_policy_input(items[0], Completion((361, 2), "red", (), "length"))
    assert x.extra["image_grid_thw"].tolist() == [[1, 4, 4]] and x.completion_ids == (361, 2)
    assert x.loss_mask[-2:] == (1, 1) and sum(x.loss_mask) == 2


def test_critic_backbone_sees_the_images(vl_path):
    from runner.models import load_causal_lm, text_config_value, text_hidden_size
    from runner.train.roles.critic import critic_backbone

    lm = load_causal_lm(vl_path)
    assert critic_backbone(lm) is lm.model and lm.model.visual is not None
    assert text_hidden_size(lm.config) == 64 == text_config_value(vl_path, "hidden_size")
    assert text_config_value(vl_path, "max_position_embeddings") == 1024


@pytest.mark.parametrize("kind,column,message", [
    ("unreadable", "image", "image 0: cannot read the image (UnidentifiedImageError"),
    ("number", "image", "image 0: a int is not an image"),
    ("video", "video", "video 0: cannot decode the video"),
])
def test_bad_media_names_the_row_and_column(packer, kind, column, message):
    from runner.data.sources import build_prompt_source
    from runner.recipe.schema import DataConfig, ValidationConfig

    d = DataConfig(factory="tests.extmods.vl.bad_media", factory_kwargs={"kind": kind},
                   prompt_column="q", response_column="a", image_column="image",
                   video_column="video" if kind == "video" else "",
                   validation=ValidationConfig(enabled=False))
    source = build_prompt_source(d, "grpo")
    source.membership_ids()  # ids read no media: no error
    packer.get_rollout_input(source.item(1))
    with pytest.raises(RecipeError) as info:
        packer.get_rollout_input(source.item(2))
    text = str(info.value)
    assert text.startswith(f"data.{column}_column: row 2 of tests.extmods.vl.bad_media("
                           f"kind='{kind}'): column '{column}', {message}"), text


def test_bad_media_stops_the_run_before_training(run_cli, tmp_path):
    rc, out, err = run_cli("--plain", "recipes/grpo-vl.toml", f"run.output_dir={tmp_path}",
                           "data.factory=tests.extmods.vl.bad_media",
                           "data.factory_kwargs.kind=number", "data.prompt_column=q",
                           "data.response_column=a", "data.validation.enabled=false",
                           "algo.prompts_per_step=4", "algo.group_size=2")
    assert rc == 2, out + err
    assert ("data.image_column: row 2 of tests.extmods.vl.bad_media(count=1000, kind='number', "
            "split='train'): column 'image', image 0: a int is not an image") in out + err
    assert not (tmp_path / "checkpoints").exists()  # nothing trained, nothing saved
    assert (not (tmp_path / "metrics.jsonl").exists()
            or not (tmp_path / "metrics.jsonl").read_text().strip())


def test_user_subclass_through_the_factory(vl_path):
    from runner.packers import build_packer
    from tests.extmods.vl import TAG, TaggedVLPacker

    p = build_packer(vl_path, "qwen3_vl", "tests.extmods.vl.build_tagged_packer")
    assert isinstance(p, TaggedVLPacker)
    item = ObsBundle(QUESTION, "red", images=(shapes("train", 1)[0].png(),))
    assert p.get_rollout_input(item).text.endswith(QUESTION + TAG + "<|eos|><|assistant|>")


def test_checkpoint_codec_is_the_processor(tmp_path, vl_path):
    """What a VL run's checkpoints save beside the weights (the ppo-vl run test loads one)."""
    from transformers import AutoProcessor

    from runner.models import load_codec

    codec = load_codec(vl_path, False)
    assert type(codec).__name__ == "Qwen3VLProcessor"
    codec.save_pretrained(tmp_path)
    assert type(AutoProcessor.from_pretrained(str(tmp_path))).__name__ == "Qwen3VLProcessor"
