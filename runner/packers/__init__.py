"""DataPackers: how canonical items become model inputs, on the rollout and the policy side."""

from runner.packers.base import DataPacker, ModelOptions, PolicyBatch, RLPolicyInput, collate
from runner.packers.decoder_only import DecoderOnlyLLMDataPacker
from runner.packers.registry import PACKERS_BY_MODEL_TYPE, build_packer

__all__ = [
    "PACKERS_BY_MODEL_TYPE",
    "DataPacker",
    "DecoderOnlyLLMDataPacker",
    "ModelOptions",
    "PolicyBatch",
    "RLPolicyInput",
    "build_packer",
    "collate",
]
