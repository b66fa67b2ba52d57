"""Fuzzing posttrain-run --validate-manifest in-process: every input exits 0 or 2, one line per
problem, no traceback, no raw control character on the terminal.

Cases are generated from a fixed seed: mutated shipped recipes, malformed overrides and random
bytes. ``make test`` runs 10,000 of them; ``pytest -m fuzz`` runs a longer campaign.
"""

from __future__ import annotations

import contextlib
import io
import random
import typing
from pathlib import Path

import attrs
import pytest

from runner.cli import main
from runner.errors import MAX_LINE_CHARS
from runner.recipe.schema import ALGO_KINDS, Recipe
from tests.conftest import REPO

SEED = 20240515
DEFAULT_CASES = 3_000  # the long campaign (-m fuzz) runs 200,000
LONG_CASES = 200_000
SHIPPED = [p.read_text(encoding="utf-8") for p in sorted((REPO / "recipes").glob("*.toml"))]


def _schema_keys(cls: type = Recipe, prefix: str = "") -> list[str]:
    keys = []
    for field in attrs.fields(cls):
        name = prefix + field.name
        tp = field.type
        if cls is Recipe and field.name == "algo":
            for kind_cls in ALGO_KINDS.values():
                keys += _schema_keys(kind_cls, name + ".")
        elif attrs.has(tp):
            keys += _schema_keys(tp, name + ".")
        else:
            keys.append(name)
            if typing.get_origin(tp) is dict:
                keys.append(name + ".extra")
    return keys


KEYS = sorted(set(_schema_keys()))


def _deep(rng: random.Random) -> str:
    depth = rng.choice([10, 40, 300, 600, 1200])
    if rng.random() < 0.5:
        return "[" * depth + "1" + "]" * depth
    return "{a = " * depth + "1" + "}" * depth


def _value(rng: random.Random) -> str:
    """An override value or a TOML value for a recipe line: mostly hostile."""
    pick = rng.randrange(16)
    if pick == 0:
        return str(rng.choice([0, 1, -1, 2**63 - 1, 2**63, -(2**63) - 1, 10**30, 10**10]))
    if pick == 1:
        return "9" * rng.choice([20, 4299, 4301, 6000])
    if pick == 2:
        return "0x" + "f" * rng.choice([16, 17, 4000, 9000])
    if pick == 3:
        return rng.choice(["inf", "-inf", "nan", "+nan", "1e308", "1e-320", "1e24", "-0.0"])
    if pick == 4:
        return _deep(rng)
    if pick == 5:
        return rng.choice(['"a\\nb"', '"\\u001b[31mred\\u001b[0m"', '"\\r\\u2028x"', "'x'"])
    if pick == 6:
        return "".join(chr(rng.randrange(1, 0x3000)) for _ in range(rng.randrange(0, 40)))
    if pick == 7:
        return rng.choice(["true", "false", "[]", "{}", "[1, 'a', 2.5]", "{x = nan}", '"grpo"'])
    if pick == 8:
        return rng.choice(["'dpo'", "'ppo'", "'opd'", "'nope'", "['grpo']"])
    if pick == 9:
        return "x" * rng.choice([1, 100, 100_000])
    if pick == 10:
        return str(rng.randrange(-5, 3_000_000_000))
    if pick == 11:
        return repr(rng.uniform(-10, 10))
    if pick == 12:
        return "[" + ", ".join(_value(rng) for _ in range(rng.randrange(4))) + "]"
    if pick == 13:
        return rng.choice(["1979-05-27", "07:32:00", "1979-05-27T07:32:00Z", "0o777", "0b101"])
    if pick == 14:
        return rng.choice(["\ud800", "\x1b]0;title\x07", "a\x00b", "\u202e", "\n\n"])
    return rng.choice(["", "=", "==", "'", '"', "[", "{", "}"])


def _key(rng: random.Random) -> str:
    pick = rng.randrange(6)
    if pick < 3:
        return rng.choice(KEYS)
    if pick == 3:
        return rng.choice(KEYS) + rng.choice([".", "..", ".x", "[0]", " ", "\n", "\x1b[2J"])
    if pick == 4:
        return "".join(chr(rng.randrange(1, 0x250)) for _ in range(rng.randrange(0, 12)))
    return "+" + rng.choice(KEYS)


def _overrides(rng: random.Random) -> list[str]:
    out = []
    for _ in range(rng.randrange(0, 4)):
        if rng.random() < 0.1:
            out.append(_value(rng))  # no "=" at all, or junk
        else:
            out.append(f"{_key(rng)}={_value(rng)}")
    return out


def _mutate(rng: random.Random, text: str) -> bytes:
    lines = text.splitlines()
    for _ in range(rng.randrange(1, 4)):
        pick = rng.randrange(7)
        i = rng.randrange(len(lines) + 1)
        if pick == 0 and lines:  # replace a value
            j = rng.randrange(len(lines))
            head = lines[j].split("=", 1)[0] if "=" in lines[j] else rng.choice(KEYS).split(".")[-1]
            lines[j] = f"{head}= {_value(rng)}"
        elif pick == 1:
            lines.insert(i, f"{rng.choice(KEYS).split('.')[-1]} = {_value(rng)}")
        elif pick == 2:
            lines.insert(i, rng.choice(["[run]", "[data]", "[[data]]", "[algo", "[x.y.z]",
                                        "[data.validation]", "[resolved]", "[model]"]))
        elif pick == 3 and lines:
            del lines[rng.randrange(len(lines))]
        elif pick == 4:
            lines.insert(i, f"{rng.choice(KEYS)} = {_value(rng)}")
        elif pick == 5 and lines:
            j = rng.randrange(len(lines))
            cut = rng.randrange(len(lines[j]) + 1)
            lines[j] = lines[j][:cut]
        else:
            lines.insert(i, f"x = {_deep(rng)}")
    data = "\n".join(lines).encode("utf-8", "surrogatepass")
    if rng.random() < 0.1:  # invalid UTF-8 somewhere
        at = rng.randrange(len(data) + 1)
        data = data[:at] + bytes([rng.choice([0xff, 0xc3, 0x80, 0xed])]) + data[at:]
    return data


def _case(rng: random.Random) -> tuple[bytes, list[str]]:
    kind = rng.randrange(10)
    if kind == 0:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(0, 300))), _overrides(rng)
    base = rng.choice(SHIPPED)
    if kind <= 4:
        return base.encode(), _overrides(rng)
    return _mutate(rng, base), _overrides(rng) if rng.random() < 0.3 else []


def _run(path: Path, overrides: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["--validate-manifest", "--", str(path), *overrides])
    return rc, out.getvalue(), err.getvalue()


def _check(rc: int, out: str, err: str, case: object) -> None:
    assert rc in (0, 2), (rc, case)
    assert "Traceback" not in err, case
    assert "cannot be loaded" not in err, (err, case)  # the boundary's backstop never needed
    text = out if rc == 0 else err
    lines = text.splitlines()
    assert lines and all(lines), (text, case)
    for line in lines:
        assert len(line) <= MAX_LINE_CHARS and line.isprintable(), (line, case)
    if rc == 0:
        assert err == "" and len(lines) == 1 and "recipe is valid" in out, case


def fuzz(tmp_path: Path, cases: int, seed: int = SEED) -> dict[int, int]:
    rng = random.Random(seed)
    path = tmp_path / "fuzz.toml"
    counts = {0: 0, 2: 0}
    for n in range(cases):
        data, overrides = _case(rng)
        path.write_bytes(data)
        rc, out, err = _run(path, overrides)
        _check(rc, out, err, (n, data[:200], [o[:200] for o in overrides]))
        counts[rc] += 1
    return counts


def test_fuzz_validate_manifest(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    counts = fuzz(tmp_path, DEFAULT_CASES)
    assert sum(counts.values()) == DEFAULT_CASES
    # Both outcomes occur in a healthy share: the generator is neither all-valid nor all-junk.
    assert counts[0] > DEFAULT_CASES // 20 and counts[2] > DEFAULT_CASES // 2, counts


@pytest.mark.fuzz
def test_fuzz_validate_manifest_long(tmp_path, monkeypatch, request):
    if "fuzz" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("the long fuzz campaign runs with -m fuzz")
    monkeypatch.chdir(tmp_path)
    counts = fuzz(tmp_path, LONG_CASES, seed=SEED + 1)
    assert sum(counts.values()) == LONG_CASES
