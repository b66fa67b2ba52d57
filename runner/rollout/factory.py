"""Build the engine a recipe asks for."""

from __future__ import annotations

from pathlib import Path

from runner.recipe.schema import Recipe
from runner.rollout.base import RolloutEngine


def make_engine(recipe: Recipe, model_path: Path, *, dtype: str, max_model_len: int | None
                ) -> RolloutEngine:
    """The engine of ``recipe.rollout`` on ``model_path`` with weights in ``dtype`` (the run's
    ``Precision.engine_dtype``), holding sequences of at most ``max_model_len`` tokens (the
    run's ``runner.rollout.lengths.PromptLimit``; None: the engine's own default). An hf engine's
    forwards are compiled with ``train.compile``, as the policy's are."""
    r = recipe.rollout
    if r.engine == "vllm":
        from runner.rollout.vllm import VLLMEngine

        return VLLMEngine(str(model_path), seed=recipe.run.seed, max_model_len=max_model_len,
                          gpu_memory_utilization=r.gpu_memory_utilization,
                          enable_sleep_mode=r.enable_sleep_mode, kv_cache_gb=r.vllm_kv_cache_gb,
                          trust_remote_code=recipe.model.trust_remote_code,
                          dtype="float32" if dtype == "float64" else dtype)
    from runner.rollout.hf import HFEngine

    return HFEngine.from_path(str(model_path), dtype=dtype, batch_size=r.batch_size,
                              trust_remote_code=recipe.model.trust_remote_code,
                              max_model_len=max_model_len, compiled=recipe.train.compile)
