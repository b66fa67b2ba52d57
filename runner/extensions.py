"""User extensions named by dotted paths: import them, check them, call them.

Every failure raises ``ExtensionError`` whose message carries the recipe key, the dotted path
and the cause, so a user can fix the recipe without reading a traceback.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Callable, Mapping
from typing import Any

from runner.errors import ExtensionError, Problem

_DOTTED = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+$")


def is_dotted_path(text: str) -> bool:
    return bool(_DOTTED.match(text))


def load_callable(dotted: str, *, key: str = "") -> Callable[..., Any]:
    """Import ``pkg.mod.attr`` (nested attributes allowed) and return it, which must be callable.

    The longest importable module prefix is imported; the rest is resolved as attributes.
    """
    if not isinstance(dotted, str) or not is_dotted_path(dotted):
        raise _error(key, dotted, "is not a dotted path like 'package.module.function'")
    parts = dotted.split(".")
    module, error = None, None
    for cut in range(len(parts) - 1, 0, -1):
        name = ".".join(parts[:cut])
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            # Only "this very module is missing" means: try a shorter prefix.
            if exc.name is not None and (name == exc.name or name.startswith(exc.name + ".")):
                error = exc
                continue
            raise _error(key, dotted, f"importing {name!r} failed: {exc}") from exc
        except Exception as exc:  # noqa: BLE001 - user code may raise anything while importing
            raise _error(key, dotted,
                         f"importing {name!r} raised {type(exc).__name__}: {exc}") from exc
        obj: Any = module
        for depth, attr in enumerate(parts[cut:], start=cut):
            if not hasattr(obj, attr):
                owner = ".".join(parts[:depth])
                raise _error(key, dotted, f"{owner!r} has no attribute {attr!r}")
            obj = getattr(obj, attr)
        if not callable(obj):
            raise _error(key, dotted, f"is a {type(obj).__name__}, not a callable")
        return obj
    missing = getattr(error, "name", None) or parts[0]
    raise _error(key, dotted, f"cannot import it: no module named {missing!r}",
                 hint="check the spelling and that its folder is on PYTHONPATH")


def check_binds(
    fn: Callable[..., Any], dotted: str, *, key: str, args: tuple = (),
    kwargs: Mapping[str, Any] | None = None
) -> None:
    """Raise ExtensionError unless ``fn(*args, **kwargs)`` would bind to ``fn``'s signature."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # builtins without a signature: nothing to check
    try:
        sig.bind(*args, **dict(kwargs or {}))
    except TypeError as exc:
        raise _error(key, dotted, f"cannot be called with these arguments: {exc}",
                     hint=f"its signature is {dotted.rsplit('.', 1)[-1]}{sig}") from exc


def call_factory(dotted: str, *, key: str, kwargs: Mapping[str, Any] | None = None) -> Any:
    """Load and call a factory, turning any failure into an ExtensionError naming ``dotted``."""
    fn = load_callable(dotted, key=key)
    check_binds(fn, dotted, key=key, kwargs=kwargs)
    try:
        return fn(**dict(kwargs or {}))
    except Exception as exc:  # noqa: BLE001 - user code may raise anything
        raise _error(key, dotted, f"raised {type(exc).__name__} when called: {exc}") from exc


def _error(key: str, dotted: Any, message: str, hint: str = "") -> ExtensionError:
    return ExtensionError([Problem(key, f"{dotted!s}: {message}", hint=hint)])
