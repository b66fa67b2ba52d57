"""Writes train.jsonl and test.jsonl beside this file: small GSM8K-style word problems.

Each line is ``{"question": ..., "answer": ...}``; the answer is a worked solution whose last line
is ``#### N`` (the GSM8K convention the ``math_verify`` reward reads). Everything is drawn from a
fixed seed, so running this again writes the same files:

    python examples/data/gsm8k-style/make.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana", "Ivo", "Jade", "Kofi",
         "Lena", "Mateo", "Nia", "Omar", "Priya"]
ITEMS = ["stickers", "apples", "pencils", "marbles", "cards", "shells", "buttons", "stamps"]


def packs(r: random.Random) -> tuple[str, list[str], int]:
    name, item = r.choice(NAMES), r.choice(ITEMS)
    a, b = r.randint(2, 9), r.randint(3, 12)
    c = r.randint(1, a * b - 1)
    return (f"{name} buys {a} packs of {item} with {b} {item} in each pack and gives {c} of them "
            f"to a friend. How many {item} does {name} have left?",
            [f"{name} buys {a} * {b} = <<{a}*{b}={a * b}>>{a * b} {item}.",
             f"After giving {c} away, {a * b} - {c} = <<{a * b}-{c}={a * b - c}>>{a * b - c} "
             "are left."],
            a * b - c)


def wages(r: random.Random) -> tuple[str, list[str], int]:
    name = r.choice(NAMES)
    pay, mon, tue = r.randint(8, 25), r.randint(2, 8), r.randint(1, 8)
    return (f"{name} earns ${pay} an hour. {name} works {mon} hours on Monday and {tue} hours on "
            "Tuesday. How many dollars does that make in total?",
            [f"{name} works {mon} + {tue} = <<{mon}+{tue}={mon + tue}>>{mon + tue} hours.",
             f"That pays {mon + tue} * {pay} = <<{mon + tue}*{pay}={(mon + tue) * pay}>>"
             f"{(mon + tue) * pay} dollars."],
            (mon + tue) * pay)


def bakery(r: random.Random) -> tuple[str, list[str], int]:
    morning, times = r.randint(5, 30), r.randint(2, 4)
    total = morning + morning * times
    sold = r.randint(2, total - 1)
    return (f"A bakery bakes {morning} loaves in the morning and {times} times as many in the "
            f"afternoon. It sells {sold} loaves. How many loaves are left?",
            [f"In the afternoon it bakes {morning} * {times} = <<{morning}*{times}="
             f"{morning * times}>>{morning * times} loaves.",
             f"In all it bakes {morning} + {morning * times} = <<{morning}+{morning * times}="
             f"{total}>>{total} loaves.",
             f"After selling {sold}, {total} - {sold} = <<{total}-{sold}={total - sold}>>"
             f"{total - sold} are left."],
            total - sold)


def together(r: random.Random) -> tuple[str, list[str], int]:
    first, second = r.sample(NAMES, 2)
    item, a, more = r.choice(ITEMS), r.randint(3, 40), r.randint(1, 20)
    return (f"{first} has {a} {item}. {second} has {more} more {item} than {first}. How many "
            f"{item} do they have together?",
            [f"{second} has {a} + {more} = <<{a}+{more}={a + more}>>{a + more} {item}.",
             f"Together they have {a} + {a + more} = <<{a}+{a + more}={2 * a + more}>>"
             f"{2 * a + more} {item}."],
            2 * a + more)


def reading(r: random.Random) -> tuple[str, list[str], int]:
    name = r.choice(NAMES)
    per_day, days = r.randint(5, 30), r.randint(2, 9)
    book = per_day * days + r.randint(1, 120)
    return (f"{name}'s book has {book} pages. {name} reads {per_day} pages a day for {days} days. "
            "How many pages are still to read?",
            [f"{name} reads {per_day} * {days} = <<{per_day}*{days}={per_day * days}>>"
             f"{per_day * days} pages.",
             f"{book} - {per_day * days} = <<{book}-{per_day * days}={book - per_day * days}>>"
             f"{book - per_day * days} pages are left."],
            book - per_day * days)


def sharing(r: random.Random) -> tuple[str, list[str], int]:
    name, item = r.choice(NAMES), r.choice(ITEMS)
    friends, each = r.randint(2, 9), r.randint(2, 15)
    return (f"{name} shares {friends * each} {item} equally among {friends} friends. How many "
            f"{item} does each friend get?",
            [f"Each friend gets {friends * each} / {friends} = <<{friends * each}/{friends}="
             f"{each}>>{each} {item}."],
            each)


def club(r: random.Random) -> tuple[str, list[str], int]:
    students = 2 * r.randint(6, 20)
    chess = r.randint(1, students // 2 - 1)
    rest = students - students // 2
    return (f"A class has {students} students. Half of them play football, and {chess} of the "
            "others play chess. How many students play neither?",
            [f"Half of {students} is {students} / 2 = <<{students}/2={students // 2}>>"
             f"{students // 2}, so {rest} do not play football.",
             f"Of those, {rest} - {chess} = <<{rest}-{chess}={rest - chess}>>{rest - chess} "
             "play neither."],
            rest - chess)


TEMPLATES = (packs, wages, bakery, together, reading, sharing, club)


def problems(count: int, r: random.Random, seen: set[str]) -> list[dict[str, str]]:
    out = []
    while len(out) < count:
        question, steps, answer = r.choice(TEMPLATES)(r)
        if question not in seen:
            seen.add(question)
            out.append({"question": question, "answer": "\n".join(steps) + f"\n#### {answer}"})
    return out


def main() -> None:
    r, seen, here = random.Random(12), set(), Path(__file__).parent
    for name, count in (("train", 240), ("test", 40)):
        lines = [json.dumps(p, ensure_ascii=False) for p in problems(count, r, seen)]
        (here / f"{name}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
