"""Typed errors that carry user-facing problems.

Library code raises these; only ``runner.launch.entry.guarded`` (used by the CLI and every rank)
renders them and picks exit codes.
A problem renders as one line: ``file: key.path: what is wrong (got X). how to fix.``
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import attrs

_MISSING = object()
MAX_KEY_CHARS = 120  # a key path longer than this is cut in messages
MAX_VALUE_CHARS = 80  # the "(got X)" part
MAX_LINE_CHARS = 1000  # one rendered problem


@attrs.frozen
class Problem:
    """One thing wrong with a recipe or an extension, with where it is and how to fix it."""

    key: str
    message: str
    hint: str = ""
    got: object = _MISSING
    source: str = ""

    def render(self, default_source: str = "") -> str:
        """One line, whatever the problem holds: user text is escaped and cut to size."""
        where = self.source or default_source
        key = safe_line(self.key, MAX_KEY_CHARS)
        parts = [f"{where}: " if where else "", f"{key}: " if key else "", self.message]
        if self.got is not _MISSING:
            parts.append(f" (got {show_value(self.got)})")
        line = _sentence("".join(parts))
        if self.hint:
            line += " " + _sentence(self.hint[:1].upper() + self.hint[1:])
        return safe_line(line, MAX_LINE_CHARS)


def _sentence(text: str) -> str:
    return text if text.endswith((".", "?", "!")) else text + "."


def _escape_char(ch: str) -> str:
    code = ord(ch)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def safe_line(text: str, limit: int = MAX_LINE_CHARS) -> str:
    """``text`` as one printable line of at most ``limit`` characters.

    Control characters (newlines, terminal escape sequences), line and paragraph separators and
    other invisible format characters are written as backslash escapes, so a value a user typed
    can neither break "one line per problem" nor reach the terminal raw.
    """
    text = str(text)
    if len(text) > 4 * limit:
        text = text[: 4 * limit]
    out = "".join(ch if ch.isprintable() or ch == " " else _escape_char(ch) for ch in text)
    return out if len(out) <= limit else out[: limit - 3] + "..."


def show_value(value: object, limit: int = MAX_VALUE_CHARS) -> str:
    """A short, safe rendering of a user value (never fails, never prints a huge number)."""
    return safe_line(_brief(value, depth=3), limit)


def _brief(value: object, depth: int) -> str:
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, int):
        if value.bit_length() > 256:
            digits = int(value.bit_length() * math.log10(2)) + 1
            return f"{'-' if value < 0 else ''}an integer of about {digits} digits"
        return repr(value)
    if isinstance(value, str):
        return repr(value[: 4 * MAX_VALUE_CHARS])
    if isinstance(value, list | tuple | dict):
        if depth <= 0:
            return "[...]" if not isinstance(value, dict) else "{...}"
        if isinstance(value, dict):
            items = [f"{_brief(k, 0)}: {_brief(v, depth - 1)}" for k, v in list(value.items())[:8]]
            more = ", ..." if len(value) > 8 else ""
            return "{" + ", ".join(items) + more + "}"
        items = [_brief(v, depth - 1) for v in list(value[:8])]
        more = ", ..." if len(value) > 8 else ""
        return ("[" if isinstance(value, list) else "(") + ", ".join(items) + more + (
            "]" if isinstance(value, list) else ")")
    if isinstance(value, float):
        return repr(value)
    try:
        return repr(value)[: 4 * MAX_VALUE_CHARS]
    except Exception:  # noqa: BLE001 - a user object's __repr__ may fail; show its type instead
        return f"<{type(value).__name__}>"


class RunnerError(Exception):
    """Base of every error the runner raises on purpose."""


class ActorDied(RunnerError):
    """A role's actor (a Ray rollout actor) died or stopped answering."""


class RecipeError(RunnerError):
    """The recipe (file or overrides) is wrong; carries every problem found at once."""

    def __init__(self, problems: Iterable[Problem], source: str = "") -> None:
        self.problems = tuple(problems)
        self.source = source
        super().__init__("\n".join(self.lines()))

    def lines(self) -> list[str]:
        return [p.render(self.source) for p in self.problems]


class ExtensionError(RecipeError):
    """A user extension (dotted path) cannot be imported, built, or breaks its contract."""


class ResumeError(RecipeError):
    """A checkpoint cannot be resumed under the recipe's resume rules."""


class RuntimeFailure(RunnerError):
    """A run failed while working; names the role and the step."""

    def __init__(self, role: str, step: int | None, message: str) -> None:
        self.role = role
        self.step = step
        where = f"{role}" + (f" at step {step}" if step is not None else "")
        super().__init__(safe_line(f"{where}: {message}"))


class NonFiniteUpdate(RuntimeFailure):
    """A training step's loss or gradient norm is not finite: the update is not applied. The
    loop fills in the step (the optimizer does not know it)."""

    def __init__(self, message: str, step: int | None = None) -> None:
        self.detail = message
        super().__init__("policy", step, message)


class RewardFailure(RuntimeFailure):
    """Reward functions failed on a batch: ``failures`` holds (function name, item index or
    None, what happened) for each one, in the recipe's order. The step fails; the loop decides
    what becomes of the run (earlier checkpoints are never touched)."""

    def __init__(self, step: int | None, failures: Iterable[tuple[str, int | None, str]]) -> None:
        self.failures = tuple(failures)
        super().__init__("reward", step, "; ".join(
            f"{name} {what}" for name, _, what in self.failures))
