#!/usr/bin/env python
"""The compatibility table (docs/releases.md), written from what the matrix's lanes really showed.

Each lane of `make test` (one venv per torch release) writes KIT_COMPAT_DIR/torch-<version>.json (tests/conftest.py):
per column, the compat-marked tests that passed, failed, or passed by checking the release's refusal. Then:
    python tests/compat_table.py report/compat                  # print the table
    python tests/compat_table.py report/compat --write docs/releases.md  # between its markers
    python tests/compat_table.py report/compat --check docs/releases.md  # fail when it says otherwise
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

COLUMNS = ["replica fairscale", "replica torch-pipe", "engine auto", "stage gpipe", "stage 1f1b",
           "stage interleaved1f1b", "stage loopedbfs", "stage interleavedzerobubble", "stage zbvzerobubble",
           "stage dualpipev", "checkpoint moves", "checker = trainer plan"]
BEGIN = "<!-- compat-table: begin (written by `make compat-table` from make test's lane results; do not edit) -->"
END = "<!-- compat-table: end -->"


def release_key(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version)[:3])


def cell(results: dict | None) -> str:
    """One column of one release: FAIL wins, then yes, then the refusal the tests checked."""
    if not results:
        return "not run"
    if results["failed"]:
        return "**FAIL**"
    if results["passed"]:
        return "yes"
    if results["refused"]:
        why = sorted({re.search(r"\(([^()]*)\)$", t).group(1) for t in results["refused"]})
        return "refused: " + "; ".join(why)
    return "skipped"


def rows(folder: Path) -> dict[str, str]:
    """release -> its Markdown row, for every lane result in `folder`."""
    out = {}
    for path in sorted(folder.glob("torch-*.json")):
        data = json.loads(path.read_text())
        cols = data["columns"]
        unknown = set(cols) - set(COLUMNS)
        if unknown:
            raise SystemExit(f"compat_table: {path} has column(s) {sorted(unknown)} not in COLUMNS; add them there")
        out[data["torch"]] = "| " + " | ".join([data["torch"], *(cell(cols.get(c)) for c in COLUMNS)]) + " |"
    return dict(sorted(out.items(), key=lambda kv: release_key(kv[0])))


def table(found: dict[str, str]) -> str:
    head = "| torch | " + " | ".join(COLUMNS) + " |\n|" + " --- |" * (len(COLUMNS) + 1)
    return "\n".join([head, *found.values()])


def readme_rows(text: str, where: str) -> tuple[int, int, dict[str, str]]:
    if BEGIN not in text or END not in text:
        raise SystemExit(f"compat_table: {where} has no compat-table markers ({BEGIN} ... {END})")
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    lines = [line for line in text[start:end].splitlines() if line.startswith("| ") and line[2].isdigit()]
    return start, end, {line.split("|")[1].strip(): line for line in lines}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", type=Path, help="the folder the lanes wrote (KIT_COMPAT_DIR)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--write", type=Path, metavar="DOC", help="replace the table between the markers")
    g.add_argument("--check", type=Path, metavar="DOC", help="exit 1 if the document's table differs")
    args = p.parse_args(argv)
    found = rows(args.results)
    if not found:
        print(f"compat_table: no lane results in {args.results}; run `make test` first", file=sys.stderr)
        return 1
    if args.write:
        text = args.write.read_text()
        start, end, _ = readme_rows(text, str(args.write))
        args.write.write_text(text[:start] + "\n" + table(found) + "\n" + text[end:])
        print(f"compat_table: wrote {len(found)} release(s) into {args.write}")
        return 0
    if args.check:
        _, _, documented = readme_rows(args.check.read_text(), str(args.check))
        wrong = [r for r in found if documented.get(r) != found[r]]
        missing = [r for r in documented if r not in found]
        for r in wrong:
            print(f"compat_table: torch {r}: {args.check} says\n  {documented.get(r, '(no row)')}\nbut the lane gave\n"
                  f"  {found[r]}", file=sys.stderr)
        if missing:
            msg = f"no lane result for torch {', '.join(missing)} (its lane did not run)"
            if os.environ.get("KIT_REQUIRE_LANES") == "1":
                print(f"compat_table: {msg}; KIT_REQUIRE_LANES=1: every lane must run", file=sys.stderr)
                return 1
            print(f"compat_table: not checked: {msg}")
        if wrong:
            print(f"compat_table: the table in {args.check} differs from what the lanes showed; "
                  "run `make compat-table` and commit it", file=sys.stderr)
            return 1
        print(f"compat_table: {args.check} agrees with the lanes for torch {', '.join(found)}")
        return 0
    print(table(found))
    return 0


if __name__ == "__main__":
    sys.exit(main())
