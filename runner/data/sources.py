"""Prompt sources for GRPO, PPO and OPD (and SFT's conversations): built-in arithmetic, a local
file, a hub dataset, or a user factory, all behind one map-style ``PromptSource``.

Which source (``[data]``, at most one of factory / path / name):
- none: the built-in arithmetic prompts, ``data.count`` of them from the training split (their
  prompt and reference columns are fixed; ``prompt_column``/``response_column`` do not apply);
- ``path``: a local file or folder read by ``datasets`` (see ``runner.data.files``);
- ``name``: a hub dataset (``config``, ``revision``, ``split``);
- ``factory``: ``factory(**factory_kwargs)`` returning rows (mappings) by index.

The held-out source (``[data.validation]``): its ``factory`` or ``path``; for a hub dataset, the
same name with ``validation.split``; for the built-in prompts, ``validation.size`` problems of the
arithmetic held-out split. A training source of another kind with no held-out source given runs
without held-out evaluation (``held_out_reason`` says so, for the plan and the start of the
run), never with a silent switch to arithmetic. Given held-out sources are capped at
``validation.size`` items (their first ones).

Train/held-out overlap is checked on membership ids: the built-in problem keys; for files and
hub datasets a hash of the raw prompt column; for a factory its own ``membership_ids()`` when it
has one, else ids from each item's canonical text (``runner.data.membership.item_id``: the
prompt, plus the raw reference of each image or video, never decoded).

Which keys may be combined (one source; PPO-only columns) is checked once, with the recipe
(``runner.recipe.checks``); the functions here take a checked ``[data]`` table.

``item(i)`` reads row ``i``, applies ``items_fn`` (row in, row out) and the column mapping; rows
are read only when asked for, never in bulk.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from runner.data import arithmetic, contract
from runner.data.columns import (
    ColumnMap,
    as_tuple,
    check_value,
    column_map,
    prompt_problem,
    reference_problem,
)
from runner.data.conversations import messages_problem
from runner.data.cursor import fingerprint_of
from runner.data.files import load_hub, load_local
from runner.data.membership import check_overlap, item_id, media_ref, text_id
from runner.data.prompt_text import prompt_chars
from runner.errors import Problem, RecipeError
from runner.extensions import load_callable
from runner.recipe.algos import ALGORITHMS
from runner.recipe.held_out import held_out_reason
from runner.recipe.schema import DataConfig
from runner.types import ObsBundle

ARITHMETIC_SEED = 0  # fixed: the built-in prompts are a pure function of the [data] keys
Row = Mapping[str, Any]


class PromptSource:
    """A map-style prompt source: ``len``, ``raw(i)``, ``item(i) -> ObsBundle`` and its identity.

    ``identity`` holds the parts that say where the rows come from (``source`` plus e.g.
    ``factory`` and ``factory_kwargs``); the fingerprint adds the indexing semantics (columns,
    items_fn, shuffle) and the length.
    """

    def __init__(self, fetch: Callable[[int], Row], length: int, *, kind: str, label: str,
                 identity: dict[str, str], columns: ColumnMap, shuffle: bool,
                 items_fn: Callable[[Row], Any] | None = None, items_fn_path: str = "",
                 membership: Callable[[], tuple[str, ...]] | None = None,
                 membership_from: str = "",
                 column_values: Callable[[str], list[Any]] | None = None) -> None:
        self._fetch, self._length = fetch, length
        self._column_values = column_values
        self.kind, self.label, self.identity = kind, label, dict(identity)
        self.columns, self.shuffle = columns, shuffle
        self._items_fn, self.items_fn_path = items_fn, items_fn_path
        self._membership = membership
        self.membership_from = membership_from or (
            "its membership ids" if membership else "each item's canonical text")

    def __len__(self) -> int:
        return self._length

    def raw(self, i: int) -> Row:
        """Row ``i`` as the source gives it (before items_fn)."""
        if not 0 <= i < self._length:
            raise IndexError(f"index {i} is outside 0..{self._length - 1} of {self.label}")
        return self._fetch(i)

    def item(self, i: int) -> ObsBundle:
        """Row ``i`` in canonical form: items_fn applied, then the column mapping. The item
        remembers the row and its media columns (``ObsBundle.origin``) so that a packer that
        cannot decode one of its media names them."""
        row = self.raw(i)
        where = f"row {i} of {self.label}"
        if self._items_fn is not None:
            row = _apply_items_fn(self._items_fn, self.items_fn_path, row, i)
            where += " after data.items_fn"
        return self.columns.apply(row, where=where)

    def check_rows(self) -> None:
        """Check the prompt and reference of every row, not only the first: a null, missing or
        malformed value is a RecipeError naming its row. Reads whole columns where the source
        has them (a ``datasets`` table, no media decoded); other sources are checked item by
        item as they are drawn."""
        if self._column_values is None or self._items_fn is not None:
            return
        checks = [(self.columns.prompt, "data.prompt_column", prompt_problem)]
        if self.columns.messages:
            checks = [(self.columns.messages, "data.messages_column", messages_problem)]
        elif self.columns.response:
            checks.append((self.columns.response, "data.response_column", reference_problem))
        for column, key, problem_of in checks:
            for i, value in enumerate(self._column_values(column)):
                check_value(problem_of(value), f"row {i} of {self.label}", column, key)

    def prompt_lengths(self) -> list[tuple[int, int]]:
        """(row, characters of its prompt) for every row, where the source reads whole columns
        (a ``datasets`` table, no items_fn): what the run checks before any prompt is
        tokenised. Other sources give [] (their prompts are checked as they are drawn)."""
        if self._column_values is None or self._items_fn is not None:
            return []
        return [(i, prompt_chars(value))
                for i, value in enumerate(self._column_values(self.columns.text))]

    def fingerprint_parts(self) -> dict[str, str]:
        return {**self.identity, "columns": self.columns.describe(),
                "items_fn": self.items_fn_path, "shuffle": str(self.shuffle).lower(),
                "length": str(self._length)}

    def fingerprint(self) -> str:
        return fingerprint_of(self.fingerprint_parts())

    def membership_ids(self) -> tuple[str, ...]:
        """Stable ids of the items for the train/held-out overlap check. From the source's own
        ids when it has them (reading no item), else from every item's canonical text."""
        if self._membership is not None:
            return self._membership()
        return tuple(item_id(self.item(i), where=f"row {i} of {self.label}")
                     for i in range(self._length))

    def describe(self) -> dict[str, str]:
        return {"kind": self.kind, "size": str(self._length), "identity": self.label}


def build_prompt_source(data: DataConfig, algo_kind: str, *, validation: bool = False
                        ) -> PromptSource:
    """The training source (or, with ``validation``, the held-out source) a recipe describes."""
    spec = ALGORITHMS[algo_kind]
    if spec.stream == "pairs":
        raise ValueError(f"{spec.title} reads preference pairs: use runner.data.preference")
    columns = column_map(data, algo_kind)
    items_fn = load_callable(data.items_fn, key="data.items_fn") if data.items_fn else None
    common = {"shuffle": data.shuffle, "items_fn": items_fn, "items_fn_path": data.items_fn}
    if not validation:
        if data.factory:
            return _from_factory(data.factory, data.factory_kwargs, "data.factory", columns,
                                 need_fp=spec.needs_fingerprint, **common)
        if data.path:
            return _from_path(data.path, data.split, ("data.path", "data.split"), columns,
                              **common)
        if data.name:
            return _from_hub(data, data.split, columns, **common)
        return _builtin(data, "train", data.count, columns, **common)
    v = data.validation
    if v.factory:
        return _from_factory(v.factory, v.factory_kwargs, "data.validation.factory", columns,
                             need_fp=False, limit=v.size, **common)
    if v.path:
        return _from_path(v.path, v.split or data.split,
                          ("data.validation.path", "data.validation.split"), columns,
                          limit=v.size, **common)
    if data.name and v.split:
        return _from_hub(data, v.split, columns, limit=v.size, **common)
    if not (data.factory or data.path or data.name):
        return _builtin(data, "held_out", v.size, columns, **common)
    raise RecipeError([Problem("data.validation", held_out_reason(data, "prompts"))])


def build_prompt_sources(data: DataConfig, algo_kind: str
                         ) -> tuple[PromptSource, PromptSource | None]:
    """Training and held-out sources (None when ``held_out_reason`` gives a reason), columns
    checked on the first row of each and the two checked not to overlap: what a run does before
    training."""
    train = build_prompt_source(data, algo_kind)
    held_out = None
    if not held_out_reason(data, "prompts"):
        held_out = build_prompt_source(data, algo_kind, validation=True)
        check_overlap(train, held_out)  # ids only: reads no item
        check_columns(held_out)
    check_columns(train)
    return train, held_out


def check_columns(source: PromptSource) -> None:
    """Map the first row (a missing column is a RecipeError naming it and the columns there),
    then check every row's prompt and reference where the source reads whole columns."""
    source.item(0)
    source.check_rows()


def _builtin(data: DataConfig, split: str, count: int, columns: ColumnMap, **common: Any
             ) -> PromptSource:
    """Rows ``{"prompt", "answer", "key"}``: prompt and reference columns are fixed, PPO's
    image / video / id / metadata columns apply as configured (e.g. ``id_column = "key"``)."""
    ops = tuple(data.operators)
    try:
        problems = arithmetic.problems(split, count, data.min_operand, data.max_operand, ops,
                                       seed=ARITHMETIC_SEED)
    except ValueError as exc:
        key = "data.operators" if "operator" in str(exc) else "data.min_operand"
        raise RecipeError([Problem(key, str(exc))]) from exc
    rows = [{"prompt": p.question, "answer": str(p.answer), "key": p.key} for p in problems]
    spec = (f"arithmetic split={split} operands={data.min_operand}..{data.max_operand} "
            f"operators={''.join(ops)} seed={ARITHMETIC_SEED}")
    return PromptSource(lambda i: dict(rows[i]), len(rows), kind="builtin",
                        label=f"built-in arithmetic ({split})",
                        identity={"source": "builtin", "builtin": spec},
                        columns=attrs.evolve(columns, prompt="prompt", response="answer",
                                             messages=""),
                        membership=lambda: tuple(p.key for p in problems),
                        membership_from="the problem keys", **common)


def _from_path(path: str, split: str, keys: tuple[str, str], columns: ColumnMap, *,
               limit: int | None = None, **common: Any) -> PromptSource:
    ds, identity = load_local(path, split, key=keys[0], split_key=keys[1])
    return _from_dataset(ds, kind="path", label=path, identity={"source": "path", **identity},
                         columns=columns, limit=limit, key=keys[0], **common)


def _from_hub(data: DataConfig, split: str, columns: ColumnMap, *, limit: int | None = None,
              **common: Any) -> PromptSource:
    ds = load_hub(data.name, data.config, data.revision, split, key="data.name")
    identity = {"source": "name", "name": data.name, "config": data.config,
                "revision": data.revision, "split": split}
    label = f"hub {data.name}" + (f"/{data.config}" if data.config else "") + f" [{split}]"
    return _from_dataset(ds, kind="name", label=label, identity=identity, columns=columns,
                         limit=limit, key="data.name", **common)


def _from_dataset(ds: Any, *, kind: str, label: str, identity: dict[str, str],
                  columns: ColumnMap, limit: int | None, key: str, **common: Any) -> PromptSource:
    length = len(ds) if limit is None else min(len(ds), limit)
    if length == 0:
        raise RecipeError([Problem(key, f"{label} has no rows")])

    def membership() -> tuple[str, ...]:
        # Hash of the raw prompt column and, with media columns, of each medium's raw reference
        # (as item_id makes them: one question about two pictures is two items); nothing is
        # decoded.
        column, key = ((columns.messages, "data.messages_column") if columns.messages
                       else (columns.prompt, "data.prompt_column"))
        if column not in ds.column_names:
            raise RecipeError([Problem(key, f"membership ids of {label} hash the raw column "
                                       f"{column!r}, which it lacks",
                                       hint=f"name a raw column in {key}")])
        rows = ds.select(range(length))
        values = rows[column]
        if not (columns.image or columns.video):
            return tuple(text_id(value) for value in values)
        media = [[as_tuple(v) for v in rows[c]] if c in rows.column_names else [()] * length
                 for c in (columns.image, columns.video)]
        return tuple(text_id({"prompt": value,
                              "images": [media_ref(m, where=f"row {i} of {label}")
                                         for m in media[0][i]],
                              "videos": [media_ref(m, where=f"row {i} of {label}")
                                         for m in media[1][i]]})
                     for i, value in enumerate(values))

    def column_values(column: str) -> list[Any]:
        return ds.select(range(length))[column] if column in ds.column_names else []

    return PromptSource(ds.__getitem__, length, kind=kind, label=label, identity=identity,
                        columns=columns, membership=membership,
                        membership_from=f"a hash of its raw {columns.text!r} column",
                        column_values=column_values, **common)


def _from_factory(dotted: str, kwargs: Mapping[str, Any], key: str, columns: ColumnMap, *,
                  need_fp: bool, limit: int | None = None, **common: Any) -> PromptSource:
    from runner.extensions import call_factory

    obj = call_factory(dotted, key=key, kwargs=kwargs)
    length = contract.check_dataset(obj, dotted=dotted, key=key)
    if limit is not None:
        length = min(length, limit)
    identity = {"source": "factory", "factory": dotted, "factory_kwargs": _canonical(kwargs)}
    own = contract.cursor_fingerprint(obj, dotted=dotted, key=key, required=need_fp)
    if own is not None:
        identity["cursor_fingerprint"] = own
    call = f"{dotted}({', '.join(f'{k}={v!r}' for k, v in sorted(kwargs.items()))})"
    # Its own metadata-only ids when it has the hook; else None: ids from each item's text.
    own_ids = None
    if callable(getattr(obj, "membership_ids", None)):
        own_ids = lambda: contract.membership_ids(obj, dotted=dotted, key=key)[:length]  # noqa: E731
    return PromptSource(
        lambda i: contract.get_row(obj, i, dotted=dotted, key=key), length, kind="factory",
        label=call, identity=identity, columns=columns, membership=own_ids,
        membership_from="its membership_ids()" if own_ids else "each item's canonical text",
        **common)


def _apply_items_fn(fn: Callable[[Row], Any], path: str, row: Row, i: int) -> Row:
    try:
        out = fn(row)
    except Exception as exc:  # noqa: BLE001 - user code may raise anything
        raise contract.extension_error("data.items_fn", path, f"raised {type(exc).__name__} on "
                                       f"row {i}: {exc}") from exc
    if not isinstance(out, Mapping):
        raise contract.extension_error("data.items_fn", path, f"returned a {type(out).__name__} "
                                       f"for row {i}, not a mapping", hint="return the row dict")
    return out


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=repr)

