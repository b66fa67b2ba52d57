"""A user DataPacker subclass that prefixes the rollout prompt (as a domain tag)."""

from runner.packers import DataPacker, DecoderOnlyLLMDataPacker
from runner.types import ObsBundle


class PrefixPacker(DecoderOnlyLLMDataPacker):
    def get_rollout_input(self, item: ObsBundle) -> str:
        return "<domain>" + super().get_rollout_input(item)


def build_prefix_packer() -> DataPacker:
    return PrefixPacker()
