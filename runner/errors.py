"""Typed errors that carry user-facing problems.

Library code raises these; only ``runner.cli`` renders them and picks exit codes.
A problem renders as one line: ``file: key.path: what is wrong (got X). how to fix.``
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

_MISSING = object()


@attrs.frozen
class Problem:
    """One thing wrong with a recipe or an extension, with where it is and how to fix it."""

    key: str
    message: str
    hint: str = ""
    got: object = _MISSING
    source: str = ""

    def render(self, default_source: str = "") -> str:
        where = self.source or default_source
        parts = [f"{where}: " if where else "", f"{self.key}: " if self.key else "", self.message]
        if self.got is not _MISSING:
            parts.append(f" (got {_show(self.got)})")
        line = _sentence("".join(parts))
        if self.hint:
            line += " " + _sentence(self.hint[:1].upper() + self.hint[1:])
        return line


def _sentence(text: str) -> str:
    return text if text.endswith((".", "?", "!")) else text + "."


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class RunnerError(Exception):
    """Base of every error the runner raises on purpose."""


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
        super().__init__(f"{where}: {message}")


class RewardFailure(RuntimeFailure):
    """Reward functions failed on a batch: ``failures`` holds (function name, item index or
    None, what happened) for each one, in the recipe's order. The step fails; the loop decides
    what becomes of the run (earlier checkpoints are never touched)."""

    def __init__(self, step: int | None, failures: Iterable[tuple[str, int | None, str]]) -> None:
        self.failures = tuple(failures)
        super().__init__("reward", step, "; ".join(
            f"{name} {what}" for name, _, what in self.failures))
