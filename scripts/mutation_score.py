"""Mutation score per module from a finished ``mutmut run`` (``make mutate``; docs/testing.md).

Reads mutmut's per-file results (``mutants/**/*.py.meta``) and the equivalent mutants listed in docs/testing.md
(table rows whose first cell is a mutant name in backticks), and prints one line per configured module:

    killed / (mutants - equivalent)

A mutant with no test that reaches it ("no tests") or that survived counts against the score; a timeout counts
as killed (the mutant made the tests run forever). ``--survivors`` lists the surviving mutants not marked
equivalent, ``--min`` makes the exit status 1 when the total score is below it.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KILLED = {1, 3, 36, 24, -24, 152, 255}  # killed, pytest internal error, timeouts (mutmut's own mapping)
SURVIVED, NO_TESTS = 0, {5, 33}
EQUIVALENT_SECTION = "### Surviving mutants judged equivalent"
EQUIVALENT = re.compile(r"^\|\s*`(?P<name>[\w.]+__mutmut_\d+)`\s*\|")


def equivalent_mutants(doc: Path) -> set[str]:
    """Mutant names in the table of the section "Surviving mutants judged equivalent" (only that section: the
    page also lists survivors that are not equivalent)."""
    if not doc.exists():
        return set()
    text = doc.read_text()
    start = text.find(EQUIVALENT_SECTION)
    if start < 0:
        return set()
    section = text[start + len(EQUIVALENT_SECTION) :].split("\n#", 1)[0]
    return {m["name"] for line in section.splitlines() if (m := EQUIVALENT.match(line))}


def module_of(mutant: str) -> str:
    return mutant.split(".x_", 1)[0] if ".x_" in mutant else mutant.rsplit(".", 1)[0]


def collect(mutants_dir: Path) -> dict[str, dict[str, int | None]]:
    by_module: dict[str, dict[str, int | None]] = {}
    for meta in sorted(mutants_dir.rglob("*.py.meta")):
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        module = ".".join(meta.relative_to(mutants_dir).with_suffix("").with_suffix("").parts)
        by_module[module] = codes
    return by_module


def classify(code: int | None) -> str:
    if code is None:
        return "not checked"
    if code in KILLED:
        return "killed"
    if code == SURVIVED:
        return "survived"
    if code in NO_TESTS:
        return "no tests"
    return "other"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mutants", default=str(REPO / "mutants"), help="mutmut's working directory")
    parser.add_argument("--doc", default=str(REPO / "docs" / "testing.md"), help="equivalent mutants' table")
    parser.add_argument("--survivors", action="store_true", help="list surviving, not-equivalent mutants")
    parser.add_argument(
        "--min", type=float, default=None, help="exit 1 when the total score is below (percent)"
    )
    args = parser.parse_args(argv)

    results = collect(Path(args.mutants))
    if not results:
        print(f"no mutmut results under {args.mutants}: run `make mutate` first", file=sys.stderr)
        return 2
    equivalent = equivalent_mutants(Path(args.doc))
    totals: Counter[str] = Counter()
    lines, survivors = [], []
    header = (
        f"{'module':52} {'mutants':>7} {'killed':>6} {'surv.':>5} {'no test':>7} {'equiv.':>6} {'score':>7}"
    )
    for module, codes in sorted(results.items()):
        counts = Counter(classify(c) for c in codes.values())
        eq = sum(1 for name, c in codes.items() if name in equivalent and classify(c) != "killed")
        scored = len(codes) - eq
        score = 100.0 * counts["killed"] / scored if scored else 100.0
        lines.append(
            f"{module:52} {len(codes):7d} {counts['killed']:6d} {counts['survived']:5d} "
            f"{counts['no tests']:7d} {eq:6d} {score:6.1f}%"
        )
        totals.update(counts)
        totals["mutants"] += len(codes)
        totals["equivalent"] += eq
        survivors += [
            name
            for name, c in codes.items()
            if classify(c) in ("survived", "no tests", "other") and name not in equivalent
        ]
    scored = totals["mutants"] - totals["equivalent"]
    total_score = 100.0 * totals["killed"] / scored if scored else 100.0
    print(header)
    print("\n".join(lines))
    print(
        f"{'total':52} {totals['mutants']:7d} {totals['killed']:6d} {totals['survived']:5d} "
        f"{totals['no tests']:7d} {totals['equivalent']:6d} {total_score:6.1f}%"
    )
    if totals["not checked"]:
        print(f"{totals['not checked']} mutants not checked: the run did not finish", file=sys.stderr)
    if args.survivors:
        print("\n".join(["", "surviving (not equivalent):", *sorted(survivors)]))
    return 1 if args.min is not None and total_score < args.min else 0


if __name__ == "__main__":
    sys.exit(main())
