"""Whether a run evaluates on a held-out set, decided from the recipe's keys alone.

The plan needs it (a DPO run with held-out pairs also builds a generation engine and the reward
functions), the data layer builds the held-out source only when it says so, and the run says
why when it trains without one.
"""

from __future__ import annotations

from runner.recipe.schema import DataConfig


def train_key(data: DataConfig) -> str:
    """The key of the recipe's own training source (``data.factory``, ``data.path`` or
    ``data.name``)."""
    return "data.factory" if data.factory else "data.path" if data.path else "data.name"


def held_out_reason(data: DataConfig, stream: str) -> str:
    """"" when a run of ``[data]`` evaluates on a held-out set; otherwise why it does not, as a
    sentence for the dry-run plan and the start of the run. ``stream`` is the data the
    algorithm trains on (``AlgoSpec.stream``: "prompts", "pairs" or "conversations").

    Preference pairs (DPO): held-out pairs whenever ``data.validation.enabled`` (a custom
    training source without a held-out source is an error, raised when the sources are built:
    the overlap check needs both sides' ``membership_ids()``). Prompt and conversation sources
    (the same selectors): the built-in
    prompts come with their held-out set; a source of the user's needs one named beside it.
    """
    v = data.validation
    if not v.enabled:
        return "off: data.validation.enabled is false"
    if stream == "pairs":
        return ""
    if (v.factory or v.path or (data.name and v.split)
            or not (data.factory or data.path or data.name)):
        return ""
    where = "data.validation.factory or data.validation.path" + (
        " (or data.validation.split of the hub dataset)" if data.name else "")
    return (f"none: no held-out set is given for the {train_key(data)} training source, so the "
            f"run trains without held-out evaluation; set {where} to evaluate")
