"""DataPackers: how canonical items become model inputs, on the rollout and the policy side."""

from runner.packers.base import (
    DataPacker,
    EnginePrompt,
    ModelExtras,
    ModelOptions,
    PolicyBatch,
    RLPolicyInput,
    collate,
)
from runner.packers.decoder_only import DecoderOnlyLLMDataPacker
from runner.packers.qwen3_vl import Qwen3VLDataPacker
from runner.packers.registry import PACKERS_BY_MODEL_TYPE, build_packer

__all__ = [
    "PACKERS_BY_MODEL_TYPE",
    "DataPacker",
    "DecoderOnlyLLMDataPacker",
    "EnginePrompt",
    "ModelExtras",
    "ModelOptions",
    "PolicyBatch",
    "Qwen3VLDataPacker",
    "RLPolicyInput",
    "build_packer",
    "collate",
]
