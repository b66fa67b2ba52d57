"""Resolve a recipe's ``model.path`` and load a model and its tokenizer from a folder.

``model.path`` is either ``builtin:NAME`` (a folder shipped with the package, or for SmolLM2
converted into the cache on first use: ``runner.models.builtin``), a local Hugging Face model
folder, or a run folder (a run's ``output_dir``), which means the model of its newest complete
checkpoint (``run_model_folder``): so SFT -> GRPO and RM -> GRPO chain without copying paths.
Importing this module imports neither torch nor transformers; the loaders import them when
called. Remote code never runs unless ``trust_remote_code`` is asked for, and weights load
from safetensors only: a folder whose weights are pickled (``pytorch_model.bin`` and the like)
is refused, never unpickled.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runner.errors import Problem, RecipeError
from runner.state.run_folder import pickled_weights

if TYPE_CHECKING:
    from runner.recipe.schema import Recipe

PREFIX = "builtin:"
# The generic tokenizer class under its transformers 4 and 5 names (5 writes the second on save).
GENERIC_TOKENIZER_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")
# Weight files that are Python pickles (torch.load), by suffix; safetensors needs no unpickling.


def _builtin_names() -> list[str]:
    from runner.models.builtin import BUILTINS

    return list(BUILTINS)


def resolve_model_path(path: str | Path, *, key: str = "model.path") -> Path:
    """``builtin:NAME`` -> its folder (shipped, or converted on first use); a folder -> itself.

    Raises ``RecipeError`` (at ``key``) for an unknown built-in name, listing the valid ones, and
    for a folder that does not exist or has no ``config.json``.
    """
    text = str(path)
    if text.startswith(PREFIX):
        from runner.models.builtin import builtin_folder

        name = text[len(PREFIX) :]
        if name not in _builtin_names():
            choices = ", ".join(PREFIX + n for n in _builtin_names())
            raise RecipeError(
                [Problem(key, "unknown built-in model", got=text, hint=f"choose one of {choices}")]
            )
        return builtin_folder(name)
    folder = Path(text).expanduser()
    if not folder.is_dir():
        hint = "give a local Hugging Face model folder, a run folder, or builtin:NAME"
        raise RecipeError([Problem(key, "model folder not found", got=text, hint=hint)])
    if (folder / "config.json").is_file():
        return folder
    if (folder / "checkpoints").is_dir():
        return run_model_folder(folder, key)
    hint = "a Hugging Face model folder holds config.json beside the weights"
    raise RecipeError([Problem(key, "the folder has no config.json", got=text, hint=hint)])


def run_model_folder(run: Path, key: str = "model.path") -> Path:
    """The model folder (``checkpoints/step-N/model``) of run folder ``run``'s newest complete
    checkpoint; a ``RecipeError`` at ``key`` when it has none, or when that checkpoint holds LoRA
    adapters rather than a whole model (``posttrain-run export`` merges them into one)."""
    from runner.state.layout import MODEL_DIR, complete_checkpoints

    done = complete_checkpoints(run / "checkpoints")
    if not done:
        raise RecipeError([Problem(key, f"the run folder {run} has no complete checkpoint",
                                   got=str(run), hint="train that run first (checkpoint."
                                   "every_steps saves them), or give a model folder")])
    model = done[-1] / MODEL_DIR
    if not (model / "config.json").is_file():
        raise RecipeError([Problem(
            key, f"the newest checkpoint of {run} ({done[-1].name}) holds no whole model "
            "(LoRA adapters)", got=str(run), hint=f"merge them into a model folder with "
            f"posttrain-run export {run} OUT_DIR, and give OUT_DIR")])
    return model


def read_model_type(path: str | Path, *, key: str = "model.path") -> str:
    """``model_type`` of a folder's config.json, read as plain JSON (no torch, no transformers).

    A ``builtin:NAME`` is answered from the table without building the model.
    """
    text = str(path)
    if text.startswith(PREFIX):
        from runner.models.builtin import BUILTIN_MODEL_TYPES

        name = text[len(PREFIX) :]
        if name in BUILTIN_MODEL_TYPES:
            return BUILTIN_MODEL_TYPES[name]
        resolve_model_path(text, key=key)  # raises the unknown-name error
    folder = Path(text).expanduser()
    if not (folder / "config.json").is_file() and (folder / "checkpoints").is_dir():
        folder = run_model_folder(folder, key)
    config = folder / "config.json"
    if not config.is_file():
        raise RecipeError([Problem(key, "the folder has no config.json", got=text)])
    return str(json.loads(config.read_text(encoding="utf-8")).get("model_type", ""))


def _folder(path: str | Path) -> Path:
    """A ``builtin:NAME`` or a run folder resolved to its model folder; any other path passed
    on as it is."""
    folder = Path(path).expanduser()
    if str(path).startswith(PREFIX) or (not (folder / "config.json").is_file()
                                        and (folder / "checkpoints").is_dir()):
        return resolve_model_path(path)
    return folder


def load_tokenizer(path: str | Path, trust_remote_code: bool = False) -> Any:
    """The tokenizer of a folder (or ``builtin:NAME``).

    A folder that declares the generic fast tokenizer class gets exactly its tokenizer.json:
    ``AutoTokenizer`` would otherwise build its model_type's class (for qwen2, Qwen2's own
    pre-tokenizer), which can split text differently from the tokenizer the model was trained
    with. The built-in tokenizers use Qwen2's pipeline, so for them both give the same ids.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    folder = _folder(path)
    config = folder / "tokenizer_config.json"
    declared = (
        json.loads(config.read_text(encoding="utf-8")).get("tokenizer_class")
        if config.is_file()
        else None
    )
    if declared in GENERIC_TOKENIZER_CLASSES:
        return PreTrainedTokenizerFast.from_pretrained(str(folder))
    try:
        return AutoTokenizer.from_pretrained(str(folder), trust_remote_code=trust_remote_code)
    except ValueError as exc:
        raise _known_failure(exc, folder, trust_remote_code) from exc


def load_codec(path: str | Path, trust_remote_code: bool = False) -> Any:
    """What turns a folder's text (and media) into ids: its processor for a vision-language model
    (tokenizer, image and video processor, chat template), else its tokenizer."""
    if is_multimodal(path):
        from transformers import AutoProcessor

        return AutoProcessor.from_pretrained(str(_folder(path)),
                                             trust_remote_code=trust_remote_code)
    return load_tokenizer(path, trust_remote_code=trust_remote_code)


def is_multimodal(path: str | Path) -> bool:
    """Whether a folder's config.json describes a vision-language model (it has a
    ``vision_config``), read as plain JSON."""
    config = _folder(path) / "config.json"
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and isinstance(data.get("vision_config"), dict)


def text_config_value(path: str | Path, name: str) -> Any:
    """A text-model fact (``hidden_size``, ``max_position_embeddings``, ...) of a folder's
    config.json: from its ``text_config`` when the model is multimodal (where VL configs keep
    them), else from the top level; None when absent."""
    data = json.loads((_folder(path) / "config.json").read_text(encoding="utf-8"))
    text = data.get("text_config")
    if isinstance(text, dict) and name in text:
        return text[name]
    return data.get(name)


def text_hidden_size(config: Any) -> int:
    """``hidden_size`` of a loaded model config, from ``text_config`` for a VL model."""
    text = getattr(config, "text_config", None)
    return int(getattr(text, "hidden_size", None) or config.hidden_size)


def check_config(path: str | Path, trust_remote_code: bool = False, *,
                 key: str = "model.path") -> None:
    """Read a folder's config.json as transformers does when the run loads the model, without
    running any code of the folder: a ``model_type`` transformers does not know, with or without
    an ``auto_map``, is the run's own ``RecipeError``. ``--validate`` calls this."""
    from transformers import AutoConfig

    folder = _folder(path)
    try:
        AutoConfig.from_pretrained(str(folder), trust_remote_code=trust_remote_code)
    except ValueError as exc:
        known = _known_failure(exc, folder, trust_remote_code)
        if isinstance(known, RecipeError):
            raise known from exc
        raise RecipeError([Problem(key, f"{folder}: transformers cannot read its config.json "
                                   f"({str(exc).strip().splitlines()[0]})")]) from exc
    except OSError as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise RecipeError([Problem(key, f"{folder}: transformers cannot read its config.json "
                                   f"({first})")]) from exc


def require_safetensors(folder: Path, key: str = "model.path") -> None:
    """Refuse a folder whose weights are pickled: loading them would run ``torch.load``."""
    found = pickled_weights(folder) if folder.is_dir() else []
    if found:
        raise RecipeError([Problem(
            key, f"{folder}: the weights are pickled ({', '.join(found[:3])}) and there is no "
            "model.safetensors: weights are loaded from safetensors only (nothing is "
            "unpickled)", hint="convert the weights to safetensors where you trust them "
            "(save_pretrained writes model.safetensors)")])


def load_causal_lm(path: str | Path, dtype: str = "float32", trust_remote_code: bool = False,
                   *, key: str = "model.path", head: str = "lm") -> Any:
    """The language model of a folder (or ``builtin:NAME``) in ``dtype``, in eval mode:
    ``AutoModelForCausalLM``, or for a vision-language folder the image-text-to-text class
    (``AutoModelForCausalLM`` refuses e.g. ``qwen3_vl``). Weights come from safetensors only;
    a folder with pickled weights is a ``RecipeError`` at ``key``. With ``head = "score"`` the
    same architecture with a scalar score head instead (``score_config``): a new head on a
    language model's folder, the trained one on a reward model's."""
    import torch

    folder = _folder(path)
    require_safetensors(folder, key)
    auto = _auto_class(folder, head, key)
    try:
        kwargs = ({"config": _config(folder, head, trust_remote_code)} if head == "score"
                  else {})
        model = auto.from_pretrained(
            str(folder), dtype=getattr(torch, dtype), trust_remote_code=trust_remote_code,
            use_safetensors=True, **kwargs,
        )
    except ValueError as exc:
        raise _known_failure(exc, folder, trust_remote_code) from exc
    return model.eval()


def _auto_class(folder: Path, head: str, key: str) -> Any:
    """The transformers auto class of the model ``head`` names for ``folder``."""
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        AutoModelForSequenceClassification,
    )

    if head == "score":
        if is_multimodal(folder):
            raise RecipeError([Problem(key, f"{folder}: a vision-language model gets no score "
                                       "head in this version", hint="use a text model")])
        return AutoModelForSequenceClassification
    return AutoModelForImageTextToText if is_multimodal(folder) else AutoModelForCausalLM


def _config(folder: Path, head: str, trust_remote_code: bool) -> Any:
    """The folder's config; for a score head ``score_config`` of it."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(folder), trust_remote_code=trust_remote_code)
    return score_config(config, folder, trust_remote_code) if head == "score" else config


def score_config(config: Any, folder: Path, trust_remote_code: bool = False) -> Any:
    """``config`` for one scalar output (``num_labels = 1``) and a ``pad_token_id`` (the
    tokenizer's pad token, else its eos): transformers scores each sequence at its last token
    that is not the pad token, and refuses batches of several without one."""
    config.num_labels = 1
    if getattr(config, "pad_token_id", None) is None:
        tok = load_tokenizer(folder, trust_remote_code)
        config.pad_token_id = (tok.pad_token_id if tok.pad_token_id is not None
                               else tok.eos_token_id)
    return config


def _known_failure(exc: ValueError, folder: Path, trust_remote_code: bool) -> Exception:
    """transformers' multi-line ValueError for a model that needs its own code (or whose
    model_type it does not know) as one recipe problem; any other ValueError as it is."""
    text = str(exc)
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        config = {}
    model_type = config.get("model_type", "") if isinstance(config, dict) else ""
    if "trust_remote_code" in text and not trust_remote_code:
        return RecipeError([Problem(
            "model.trust_remote_code", f"{folder}: model_type {model_type!r} needs the Python "
            "code in the model folder (its auto_map), which runs only when allowed",
            got=False, hint="set model.trust_remote_code = true if you trust that code, or use "
            "a model whose type transformers knows")])
    if "instantiate the backend tokenizer" in text:
        return RecipeError([Problem(
            "model.path", f"{folder}: holds no tokenizer transformers can load",
            hint="a model folder needs tokenizer.json (or a slow tokenizer's files)")])
    if "does not recognize this architecture" in text or "Unrecognized" in text:
        return RecipeError([Problem(
            "model.path", f"{folder}: transformers does not know model_type {model_type!r} and "
            "the folder brings no code for it", hint="upgrade transformers or use another model")])
    return exc


def empty_causal_lm(path: str | Path, dtype: str = "float32", trust_remote_code: bool = False,
                    *, key: str = "model.path", head: str = "lm") -> Any:
    """``load_causal_lm``'s model without its weights: the parameters on the meta device (no
    memory), the buffers computed on the CPU as a load computes them. Sharded ranks fill in
    their own shards from the folder's files (runner.train.roles.sharding.fill_shards)."""
    import torch
    from accelerate import init_empty_weights

    folder = _folder(path)
    require_safetensors(folder, key)
    auto = _auto_class(folder, head, key)
    try:
        config = _config(folder, head, trust_remote_code)
        with init_empty_weights(include_buffers=False):
            model = auto.from_config(config, dtype=getattr(torch, dtype),
                                     trust_remote_code=trust_remote_code)
    except ValueError as exc:
        raise _known_failure(exc, folder, trust_remote_code) from exc
    model.tie_weights()  # as from_pretrained ties them (e.g. the LM head to the embeddings)
    return model.eval()


def run_folder_models(recipe: Recipe) -> dict[str, str]:
    """``{recipe key: model folder}`` for every model the recipe names by a run folder (its
    newest complete checkpoint's model, as the run loads it); a folder that does not resolve is
    left out (the run refuses it with its own error)."""
    from runner.recipe.algos import spec_of
    from runner.recipe.reward_names import model_rewards

    named = [("model.path", recipe.model.path)]
    named += [(m.key, m.path) for m in spec_of(recipe).models(recipe.algo)]
    named += model_rewards(recipe.reward.functions)
    found = {}
    for key, path in named:
        folder = Path(path).expanduser()
        if (folder / "checkpoints").is_dir() and not (folder / "config.json").is_file():
            try:
                found[key] = str(run_model_folder(folder, key))
            except RecipeError:
                continue
    return found
