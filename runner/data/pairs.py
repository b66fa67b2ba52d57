"""Preference pairs for DPO: where ``(prompt, chosen, rejected)`` items come from.

Sources (``DatasetPreferenceEnv`` picks one):
- a factory returning items ``(prompt, winner, loser)`` by index;
- a jsonl file: one JSON object per line with the prompt under ``data.prompt_column`` and the
  answers under ``data.chosen_key`` / ``data.rejected_key`` (by default ``chosen`` or
  ``winner``, and ``rejected`` or ``loser``); blank lines are skipped;
- a tar archive (plain or compressed): every regular member whose name ends in ``.json`` is one
  sample, an object with the same keys as a jsonl line; samples are taken in member-name order
  and other regular members (a README, a licence) are ignored. The archive is read to its end
  or refused (``runner.data.tar_samples``): members one by one, at most
  ``data.tar_member_max_bytes`` each and ``data.tar_max_bytes`` decompressed in all, nothing
  extracted to disk;
- built-in arithmetic pairs: the correct answer preferred to a wrong one.

File answers must be text or tables (a number, null or a list is refused with the file and
line); chosen and rejected must have the same payload shape: both text, both mappings with the same
keys (values compared the same way), or both lists of the same length.

With ``data.margin_column`` (reward models), every file sample also carries that field, a finite
number (int or float, not a boolean): the pair's margin, 0 without the column. A factory's items
are then mappings with the keys of a file sample instead of triples. The built-in arithmetic
pairs carry no margin.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs

from runner.data import arithmetic, contract
from runner.data.cursor import fingerprint_of
from runner.data.files import BOM, DuplicateKey, digest_files, unique_keys
from runner.data.membership import text_id
from runner.data.tar_samples import read_tar_samples
from runner.errors import ExtensionError, Problem, RecipeError

Triple = tuple[Any, Any, Any]
Quad = tuple[Any, Any, Any, float]  # a triple and its margin
TAR_MEMBER_MAX_BYTES = 64 * 2**20  # the default of data.tar_member_max_bytes
TAR_MAX_BYTES = 2 * 2**30  # the default of data.tar_max_bytes


@attrs.frozen
class PreferencePair:
    """One DPO item: ``chosen`` is preferred to ``rejected`` as an answer to ``prompt``;
    ``margin`` (reward models, ``data.margin_column``; else 0) is by how much."""

    prompt: Any
    chosen: Any
    rejected: Any
    id: str
    margin: float = 0.0


@attrs.frozen
class PairKeys:
    """Field names of a file sample; empty answer keys accept the two usual spellings; an empty
    ``margin`` reads no margin."""

    prompt: str = "prompt"
    chosen: str = ""
    rejected: str = ""
    margin: str = ""

    def describe(self) -> str:
        margin = f" margin={self.margin}" if self.margin else ""  # unchanged without one
        return (f"prompt={self.prompt} chosen={self.chosen or 'chosen|winner'} "
                f"rejected={self.rejected or 'rejected|loser'}{margin}")


class PairSource:
    """A map-style source of preference pairs with its identity and membership ids."""

    def __init__(self, fetch: Callable[[int], Quad], length: int, *, kind: str, label: str,
                 identity: dict[str, str], shuffle: bool, split: str, key: str,
                 membership: Callable[[], tuple[str, ...]], checked: bool = False) -> None:
        self._fetch, self._length = fetch, length
        self.kind, self.label, self.identity = kind, label, dict(identity)
        self.shuffle, self.split, self.key = shuffle, split, key
        self._membership, self._checked = membership, checked

    def __len__(self) -> int:
        return self._length

    def pair(self, i: int) -> PreferencePair:
        if not 0 <= i < self._length:
            raise IndexError(f"index {i} is outside 0..{self._length - 1} of {self.label}")
        prompt, chosen, rejected, margin = self._fetch(i)
        if not self._checked:
            mismatch = shape_mismatch(chosen, rejected)
            if mismatch:
                raise _shape_error(self.key, self.label, f"item {i}", mismatch)
        return PreferencePair(prompt, chosen, rejected, id=f"{self.split}-{i}", margin=margin)

    def fingerprint_parts(self) -> dict[str, str]:
        return {**self.identity, "shuffle": str(self.shuffle).lower(),
                "length": str(self._length)}

    def fingerprint(self) -> str:
        return fingerprint_of(self.fingerprint_parts())

    def membership_ids(self) -> tuple[str, ...]:
        """Stable ids for the train/held-out overlap check; reads no item of a factory."""
        return self._membership()

    def describe(self) -> dict[str, str]:
        return {"kind": self.kind, "size": str(self._length), "identity": self.label}


def shape_mismatch(chosen: Any, rejected: Any, where: str = "") -> str:
    """Why two payloads differ in shape, or "" when they match."""
    at = f" at {where}" if where else ""
    if isinstance(chosen, str) and isinstance(rejected, str):
        return ""
    if isinstance(chosen, Mapping) and isinstance(rejected, Mapping):
        if set(chosen) != set(rejected):
            return f"chosen has keys {sorted(chosen)} but rejected {sorted(rejected)}{at}"
        for k in sorted(chosen):
            inner = shape_mismatch(chosen[k], rejected[k], f"{where}[{k!r}]")
            if inner:
                return inner
        return ""
    if isinstance(chosen, list | tuple) and isinstance(rejected, list | tuple):
        if len(chosen) != len(rejected):
            return f"chosen has {len(chosen)} elements but rejected {len(rejected)}{at}"
        for n, (c, r) in enumerate(zip(chosen, rejected, strict=True)):
            inner = shape_mismatch(c, r, f"{where}[{n}]")
            if inner:
                return inner
        return ""
    if type(chosen) is not type(rejected):
        return f"chosen is a {type(chosen).__name__} but rejected a {type(rejected).__name__}{at}"
    return ""


def _shape_error(key: str, label: str, where: str, mismatch: str) -> RecipeError:
    problem = Problem(key, f"{label}: {where}: chosen and rejected differ in shape: {mismatch}",
                      hint="give both answers the same payload shape (both text, or both "
                      "mappings with the same keys)")
    return (ExtensionError if key.endswith("factory") else RecipeError)([problem])


def factory_pairs(dotted: str, kwargs: Mapping[str, Any], *, key: str, shuffle: bool,
                  split: str, need_ids: bool, limit: int | None = None,
                  keys: PairKeys | None = None) -> PairSource:
    """Pairs of a factory: items ``(prompt, winner, loser)``, or, when ``keys.margin`` is set,
    mappings read like a file sample (``keys``' fields, the margin's among them)."""
    from runner.extensions import call_factory

    obj = call_factory(dotted, key=key, kwargs=kwargs)
    length = contract.check_dataset(obj, dotted=dotted, key=key)
    length = length if limit is None else min(length, limit)
    identity = {"source": "factory", "factory": dotted,
                "factory_kwargs": json.dumps(kwargs, sort_keys=True, default=repr)}
    own = contract.cursor_fingerprint(obj, dotted=dotted, key=key, required=False)
    if own is not None:
        identity["cursor_fingerprint"] = own
    margin = keys.margin if keys is not None else ""
    if margin:
        identity["keys"] = keys.describe()
    if need_ids:
        contract.require_membership_hook(obj, dotted=dotted, key=key)
    call = f"{dotted}({', '.join(f'{k}={v!r}' for k, v in sorted(kwargs.items()))})"

    def fetch(i: int) -> Quad:
        item = contract.get_item(obj, i, dotted=dotted, key=key)
        if margin:
            if not isinstance(item, Mapping):
                raise contract.extension_error(
                    key, dotted, f"item {i} is a {type(item).__name__}, not a mapping with the "
                    f"margin field {margin!r} (data.margin_column)",
                    hint="return each pair as a dict with the keys of a jsonl sample")
            return _quad(item, keys, key, call, f"item {i}", joiner=": ")
        if isinstance(item, str | bytes | Mapping) or not (
                isinstance(item, tuple | list) and len(item) == 3):
            raise contract.extension_error(key, dotted, f"item {i} is a {type(item).__name__}, "
                                           "not a (prompt, winner, loser) triple")
        return (*item, 0.0)

    return PairSource(fetch, length, kind="factory", label=call, identity=identity,
                      shuffle=shuffle, split=split, key=key,
                      membership=lambda: contract.membership_ids(obj, dotted=dotted, key=key))


def file_pairs(path: str, keys: PairKeys, *, kind: str, key: str, shuffle: bool, split: str,
               limit: int | None = None,
               max_member_bytes: int = TAR_MEMBER_MAX_BYTES,
               max_total_bytes: int = TAR_MAX_BYTES) -> PairSource:
    """Pairs of a jsonl file (``kind="jsonl"``) or a tar archive (``kind="tar"``)."""
    file = Path(path)
    if not file.is_file():
        raise RecipeError([Problem(key, "no such file", got=path)])
    if kind == "jsonl":
        samples = _read_jsonl(file, key)
    else:
        samples = read_tar_samples(file, key, max_member_bytes, max_total_bytes)
    if not samples:
        empty = "is empty" if file.stat().st_size == 0 else "holds no preference pairs"
        raise RecipeError([Problem(key, f"{path} {empty}")])
    quads = [_quad(sample, keys, key, path, where) for where, sample in samples]
    quads = quads if limit is None else quads[:limit]
    size, sha = digest_files(path, [file])
    identity = {"source": kind, "path": path, "file_size": str(size), "content_sha256": sha,
                "keys": keys.describe()}
    return PairSource(quads.__getitem__, len(quads), kind=kind, label=path,
                      identity=identity, shuffle=shuffle, split=split, key=key, checked=True,
                      membership=lambda: tuple(text_id(t[0]) for t in quads))


def _read_jsonl(file: Path, key: str) -> list[tuple[str, Any]]:
    """``(where, parsed JSON)`` per non-blank line; lines are numbered as an editor shows them."""
    samples = []
    with file.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            where = f"{file} line {number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise RecipeError([Problem(key, f"{where}: not valid UTF-8 ({exc.reason} at "
                                           f"byte {exc.start + 1} of the line)",
                                           hint="save the file as UTF-8")]) from None
            if number == 1 and line.startswith(BOM):  # as datasets reads data.path files
                line = line[len(BOM):]
            if not line.strip():
                continue
            try:
                samples.append((f"line {number}", json.loads(line.rstrip("\r\n"),
                                                             object_pairs_hook=unique_keys)))
            except DuplicateKey as exc:
                raise RecipeError([Problem(key, f"{where}: the key {exc.name!r} appears twice",
                                           hint="give each key once per line")]) from None
            except json.JSONDecodeError as exc:
                raise RecipeError([Problem(key, f"{where}: not valid JSON "
                                           f"({exc.msg} at column {exc.colno})",
                                           hint="write one JSON object per line")]) from None
            except RecursionError:
                raise RecipeError([Problem(key, f"{where}: JSON nested too deeply")]) from None
    return samples


def _quad(sample: Any, keys: PairKeys, key: str, label: str, where: str, *, joiner: str = " "
          ) -> Quad:
    """``(prompt, chosen, rejected, margin)`` of one sample; errors name it as ``label`` (the
    file, or the factory call) and ``where`` (the line or member, or the item)."""
    at = f"{label}{joiner}{where}"
    error = _error_class(key)
    if not isinstance(sample, Mapping):
        raise error([Problem(key, f"{at}: expected a JSON object, got a "
                             f"{type(sample).__name__}")])

    def pick(names: tuple[str, ...], setting: str) -> Any:
        for name in names:
            if name in sample:
                return sample[name]
        raise error([Problem(key, f"{at}: no {' or '.join(map(repr, names))} "
                             f"key (its keys: {', '.join(map(repr, sample))})",
                             hint=f"set {setting} to the right key")])

    prompt = pick((keys.prompt,), "data.prompt_column")
    chosen = pick((keys.chosen,) if keys.chosen else ("chosen", "winner"), "data.chosen_key")
    rejected = pick((keys.rejected,) if keys.rejected else ("rejected", "loser"),
                    "data.rejected_key")
    if isinstance(prompt, Mapping):
        raise error([Problem(key, f"{at}: the prompt is a mapping, not text",
                             got=prompt, hint="write the prompt as a JSON string")])
    for name, value in (("prompt", prompt), ("chosen", chosen), ("rejected", rejected)):
        if not isinstance(value, str | Mapping):
            raise error([Problem(key, f"{at}: the {name} is "
                                 f"{_json_kind(value)}, not text", got=value,
                                 hint=f"write the {name} as a JSON string")])
    mismatch = shape_mismatch(chosen, rejected)
    if mismatch:
        raise _shape_error(key, label, where, mismatch)
    margin = (_margin(pick((keys.margin,), "data.margin_column"), keys.margin, key, at, error)
              if keys.margin else 0.0)
    return prompt, chosen, rejected, margin


def _error_class(key: str) -> type[RecipeError]:
    """A factory's bad item is the extension's error; a file's, the recipe's."""
    return ExtensionError if key.endswith("factory") else RecipeError


def _margin(value: Any, name: str, key: str, at: str, error: type[RecipeError]) -> float:
    """A sample's margin field ``name``: a finite int or float (not a boolean), as a float."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise error([Problem(key, f"{at}: the margin {name!r} is {_json_kind(value)}, not a "
                             "number", got=value, hint="write the margin as a JSON number")])
    try:
        margin = float(value)
    except OverflowError:  # an integer beyond any float
        margin = math.inf
    if not math.isfinite(margin):
        raise error([Problem(key, f"{at}: the margin {name!r} is not a finite number",
                             got=value, hint="give every pair a finite margin")])
    return margin


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, str):
        return "text"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    return "a list" if isinstance(value, list) else f"a {type(value).__name__}"


def near_miss_offset(problem_key: str) -> int:
    """The rejected answer's offset from the right one for ``near_miss`` pairs: one of -3, -2,
    -1, 1, 2, 3, a function of the problem alone (so every run, rank and resume agrees)."""
    return (-3, -2, -1, 1, 2, 3)[zlib.crc32(problem_key.encode()) % 6]


def synthetic_pairs(count: int, split: str, *, lo: int, hi: int, ops: tuple[str, ...],
                    shuffle: bool, key: str, rejected: str = "one_too_high") -> PairSource:
    """Arithmetic pairs: the right answer preferred to a wrong one.

    ``rejected = "one_too_high"``: the answer one too high, the near miss that
    ``builtin:tiny-arith`` habitually writes (its warm-up slip), so DPO teaches a model that
    knows roughly where the answer is which of two close candidates is right. Every rejected
    answer is then larger than its chosen one, so "the smaller number wins" orders every pair:
    a reward model trained on them learns that rule and prefers a too-low answer to the right
    one. ``"near_miss"``: the right answer plus an offset in -3..-1, 1..3, fixed per problem
    (``near_miss_offset``), so no order of the numbers alone separates the pairs.
    """
    try:
        problems = arithmetic.problems(split, count, lo, hi, ops, seed=0)
    except ValueError as exc:
        raise RecipeError([Problem("data.operators" if "operator" in str(exc)
                                   else "data.min_operand", str(exc))]) from exc
    near = rejected == "near_miss"

    def fetch(i: int) -> Quad:
        p = problems[i]
        offset = near_miss_offset(p.key) if near else 1
        return p.question, str(p.answer), str(p.answer + offset), 0.0

    spec = (f"arithmetic-pairs rejected={'near-miss' if near else 'answer+1'} split={split} "
            f"operands={lo}..{hi} operators={''.join(ops)} seed=0")
    return PairSource(fetch, len(problems), kind="builtin", label=f"built-in arithmetic pairs "
                      f"({split})", identity={"source": "builtin", "builtin": spec},
                      shuffle=shuffle, split=split, key=key, checked=True,
                      membership=lambda: tuple(p.key for p in problems))

