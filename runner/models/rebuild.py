"""Rebuild the shipped built-in models: ``python -m runner.models.rebuild [--check] [NAME ...]``.

Without names it rebuilds every shipped model (``runner.models.builtin.SHIPPED``) into
``runner/models/shipped/`` (a few minutes on one thread). The weights depend on the CPU's float
kernels, so a rebuild on another CPU changes them, and with them every number pinned against
them (``tests/data/pinned_steps.json``, the README's recipe table): rebuild only on purpose,
then regenerate the pins. ``--check`` builds into a temporary folder and says, per file, whether
this machine reproduces the shipped bits; it changes nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from runner.models.builtin import BUILTINS, INFO, SHIPPED, SHIPPED_ROOT, build_into, file_hashes


def _compare(name: str, shipped: Path, built: Path) -> bool:
    info = shipped / INFO
    old = json.loads(info.read_text(encoding="utf-8")).get("files", {}) if info.is_file() else {}
    new = file_hashes(built)
    same = old == new
    for file in sorted(set(old) | set(new)):
        state = "same" if old.get(file) == new.get(file) else "differs"
        print(f"  {name}/{file}: {state}")
    return same


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runner.models.rebuild",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"of {', '.join(SHIPPED)}")
    parser.add_argument("--check", action="store_true",
                        help="build into a temporary folder and compare with the shipped files")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in SHIPPED]
    if unknown:
        print(f"not a shipped built-in model: {', '.join(unknown)} (choose from "
              f"{', '.join(SHIPPED)})", file=sys.stderr)
        return 2
    every_same = True
    for name in args.names or SHIPPED:
        if args.check:
            with tempfile.TemporaryDirectory() as tmp:
                built = build_into(Path(tmp) / name, BUILTINS[name])
                every_same &= _compare(name, SHIPPED_ROOT / name, built)
        else:
            build_into(SHIPPED_ROOT / name, BUILTINS[name], replace=True)
            print(f"rebuilt {SHIPPED_ROOT / name}")
    if args.check:
        print("this machine reproduces the shipped files" if every_same
              else "this machine builds other bits than the shipped files")
    return 0 if every_same else 1


if __name__ == "__main__":
    sys.exit(main())
