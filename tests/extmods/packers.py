"""A user DataPacker subclass that prefixes the rollout prompt (as a domain tag)."""

from runner.packers import DataPacker, DecoderOnlyLLMDataPacker
from runner.types import ObsBundle


class PrefixPacker(DecoderOnlyLLMDataPacker):
    def get_rollout_input(self, item: ObsBundle) -> str:
        return "<domain>" + super().get_rollout_input(item)


def build_prefix_packer() -> DataPacker:
    return PrefixPacker()


class IncompletePacker(DataPacker):
    """Implements only the rollout side: the loops' other calls are missing."""

    def get_rollout_input(self, item: ObsBundle) -> str:
        return str(item.prompt)

    def encode_rollout_input(self, rollout_input):
        return []

    def get_policy_input(self, sample, rollout_output, n_ignore_prefix_tokens=0, *,
                         prompt_ids=None):
        raise NotImplementedError


def build_incomplete_packer() -> DataPacker:
    return IncompletePacker()


class RecordingPacker(DecoderOnlyLLMDataPacker):
    """Records the model options it saw when setup ran."""

    def setup(self, model_path: str) -> None:
        self.seen_at_setup = (self.model_options.trust_remote_code, self.model_options.dtype)
        super().setup(model_path)


def build_recording_packer() -> DataPacker:
    return RecordingPacker()
