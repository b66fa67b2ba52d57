"""Rollout engines: ``hf`` (transformers generate) and ``vllm`` (imported lazily)."""

from runner.rollout.base import Completion, RolloutEngine, RolloutOutput, SamplingConfig

__all__ = ["Completion", "RolloutEngine", "RolloutOutput", "SamplingConfig"]
