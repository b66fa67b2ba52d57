"""Which DataPacker a model gets: the recipe's factory, else the explicit model_type table."""

from __future__ import annotations

from collections.abc import Callable

import attrs

from runner.errors import ExtensionError, Problem, RecipeError
from runner.extensions import call_factory
from runner.packers.base import DataPacker, ModelOptions
from runner.packers.decoder_only import DecoderOnlyLLMDataPacker
from runner.packers.qwen3_vl import Qwen3VLDataPacker

# model_type (from config.json) -> zero-argument packer factory. Explicit, filled by no import.
PACKERS_BY_MODEL_TYPE: dict[str, Callable[[], DataPacker]] = {
    "qwen2": DecoderOnlyLLMDataPacker,
    "qwen3": DecoderOnlyLLMDataPacker,
    "llama": DecoderOnlyLLMDataPacker,
    "mistral": DecoderOnlyLLMDataPacker,
    "gpt2": DecoderOnlyLLMDataPacker,
    "qwen3_vl": Qwen3VLDataPacker,
    "qwen2_5_vl": Qwen3VLDataPacker,  # the same processor contract (tests/test_qwen2_vl_packers.py)
    "qwen2_vl": Qwen3VLDataPacker,
}


def build_packer(model_path: str, model_type: str, factory: str = "", *,
                 key: str = "data_packer.factory", trust_remote_code: bool = False,
                 dtype: str = "float32") -> DataPacker:
    """A fresh, set-up packer for the model at ``model_path``.

    ``factory`` (a dotted zero-argument callable) wins; otherwise ``model_type`` picks from
    ``PACKERS_BY_MODEL_TYPE``. Each call constructs a new instance: roles never share one.
    ``trust_remote_code`` and ``dtype`` (the recipe's ``model.*`` keys) reach the packer as
    ``packer.model_options`` before ``setup(model_path)`` runs. A packer class that lacks one of
    the methods ``DataPacker`` declares fails here, in its factory, with the methods named.
    """
    if factory:
        try:
            packer = call_factory(factory, key=key)
        except ExtensionError as exc:
            if isinstance(exc.__cause__, TypeError) and "abstract" in str(exc.__cause__):
                raise ExtensionError([attrs.evolve(
                    p, hint="implement them (see runner.packers.DataPacker), or subclass "
                    "runner.packers.DecoderOnlyLLMDataPacker") for p in exc.problems]) from exc
            raise
        if not isinstance(packer, DataPacker):
            raise ExtensionError([Problem(key, f"{factory}: returned {type(packer).__name__}, "
                                          "not a DataPacker", hint="return an instance of a "
                                          "runner.packers.DataPacker subclass")])
    else:
        try:
            packer = PACKERS_BY_MODEL_TYPE[model_type]()
        except KeyError:
            raise RecipeError([Problem("model.model_type", "no built-in DataPacker for this "
                                       "model_type", got=model_type,
                                       hint="set data_packer.factory to a packer factory; "
                                       "built-in types: " + ", ".join(PACKERS_BY_MODEL_TYPE))]
                              ) from None
    packer.model_options = ModelOptions(trust_remote_code=trust_remote_code, dtype=dtype)
    try:
        packer.setup(str(model_path))
    except Exception as exc:  # noqa: BLE001 - user packers may raise anything
        name = factory or type(packer).__name__
        raise ExtensionError([Problem(key, f"{name}: setup({str(model_path)!r}) raised "
                                      f"{type(exc).__name__}: {exc}")]) from exc
    return packer
