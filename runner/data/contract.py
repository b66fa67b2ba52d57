"""The contract a dataset factory's return value must keep, checked with the dotted path in hand.

A factory returns a non-empty map-style object: ``len(obj)`` and ``obj[i]`` for ``i`` in
``0..len-1``. Optional hooks: ``cursor_fingerprint() -> str`` (required for PPO) and
``membership_ids() -> tuple[str, ...]`` (required when validation is on). Every failure is an
ExtensionError whose message starts with the dotted path.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from runner.errors import ExtensionError, Problem


def extension_error(key: str, dotted: str, message: str, hint: str = "") -> ExtensionError:
    return ExtensionError([Problem(key, f"{dotted}: {message}", hint=hint)])


def check_dataset(obj: Any, *, dotted: str, key: str) -> int:
    """Check ``obj`` is a non-empty map-style dataset and return its length."""
    kind = type(obj).__name__
    indexable = hasattr(obj, "__len__") and hasattr(obj, "__getitem__")
    if not indexable and hasattr(obj, "__iter__"):
        raise extension_error(
            key, dotted, f"returned an iterable-only {kind} (it has no __len__ and __getitem__); "
            "stable indexing is needed for rank sharding and exact resume",
            hint="return a list or a map-style dataset, e.g. datasets.Dataset rather than "
            "IterableDataset")
    if not indexable or isinstance(obj, str | bytes | Mapping):
        raise extension_error(
            key, dotted, f"returned an object of type {kind}, not a map-style dataset with "
            "__len__ and __getitem__ over positions 0..n-1",
            hint="return a list of rows or a dataset object")
    try:
        length = len(obj)
    except Exception as exc:  # noqa: BLE001 - user code may raise anything
        raise extension_error(key, dotted, f"len() of the returned {kind} raised "
                              f"{type(exc).__name__}: {exc}") from exc
    if length == 0:
        raise extension_error(key, dotted, f"returned an empty {kind}",
                              hint="check factory_kwargs; a dataset needs at least one item")
    return length


def get_item(obj: Any, index: int, *, dotted: str, key: str) -> Any:
    """``obj[index]``, with any exception turned into an error naming ``dotted`` and the index."""
    try:
        return obj[index]
    except Exception as exc:  # noqa: BLE001 - user code may raise anything
        raise extension_error(key, dotted, f"item {index} raised {type(exc).__name__}: "
                              f"{exc}") from exc


def get_row(obj: Any, index: int, *, dotted: str, key: str) -> Mapping[str, Any]:
    """``obj[index]``, which must be a mapping of column names to values."""
    row = get_item(obj, index, dotted=dotted, key=key)
    if not isinstance(row, Mapping):
        raise extension_error(key, dotted, f"item {index} is a {type(row).__name__}, not a "
                              "mapping of column names to values",
                              hint="return rows as dicts, e.g. {'question': ..., 'answer': ...}")
    return row


def cursor_fingerprint(obj: Any, *, dotted: str, key: str, required: bool) -> str | None:
    """The source's own ``cursor_fingerprint()``, or None when it has none and none is required."""
    hook = getattr(obj, "cursor_fingerprint", None)
    if hook is None:
        if required:
            raise extension_error(
                key, dotted, f"the returned {type(obj).__name__} has no cursor_fingerprint() "
                "method, which PPO needs to checkpoint the data cursor",
                hint="add cursor_fingerprint() -> str returning a stable identity that changes "
                "whenever the indexed content or its order changes")
        return None
    value = _call_hook(hook, "cursor_fingerprint", dotted=dotted, key=key)
    if not isinstance(value, str) or not value:
        raise extension_error(key, dotted, "cursor_fingerprint() must return a non-empty str",
                              hint=f"it returned {value!r}")
    return value


def require_membership_hook(obj: Any, *, dotted: str, key: str) -> None:
    """Refuse a source without ``membership_ids()`` when validation needs one; reads no item."""
    if not callable(getattr(obj, "membership_ids", None)):
        raise extension_error(
            key, dotted, f"the returned {type(obj).__name__} has no membership_ids() method, "
            "which validation needs to check that no held-out item is trained on",
            hint="add membership_ids() -> tuple[str, ...] built from metadata only (never "
            "decode media), or set data.validation.enabled=false")


def membership_ids(obj: Any, *, dotted: str, key: str) -> tuple[str, ...]:
    """The source's ``membership_ids()``, checked to be strings."""
    require_membership_hook(obj, dotted=dotted, key=key)
    ids = _call_hook(obj.membership_ids, "membership_ids", dotted=dotted, key=key)
    if isinstance(ids, str | bytes) or not hasattr(ids, "__iter__"):
        raise extension_error(key, dotted, "membership_ids() must return a tuple of str",
                              hint=f"it returned a {type(ids).__name__}")
    ids = tuple(ids)
    bad = next((x for x in ids if not isinstance(x, str)), None)
    if bad is not None:
        raise extension_error(key, dotted, "membership_ids() must return a tuple of str",
                              hint=f"one id is {bad!r}")
    return ids


def _call_hook(hook: Any, name: str, *, dotted: str, key: str) -> Any:
    try:
        return hook()
    except Exception as exc:  # noqa: BLE001 - user code may raise anything
        raise extension_error(key, dotted, f"{name}() raised {type(exc).__name__}: "
                              f"{exc}") from exc
