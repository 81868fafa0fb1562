"""docs/metrics.md §9 names, for every metric, the tests that pin its value (issue 15). A renamed or deleted test
would leave the page pointing at nothing: this test resolves every name in that table to a test function that
exists, and checks that each of the ten row metrics of §1 has a row with at least one test."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
DOC = REPO / "docs" / "metrics.md"
# Where a bare file name (no "/") points in each column, unless it lies beside the cell's previous file.
COLUMN_DIRS = (TESTS / "engine" / "reference", TESTS / "engine" / "moe_infinity", TESTS)
REFERENCE = re.compile(r"`([\w/]+\.py)?(?:::(\w+))?`")


def pinning_table() -> list[list[str]]:
    text = DOC.read_text()
    section = text.split("## 9. Which test pins each value", 1)[1]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| value")]
    return [[cell.strip() for cell in row.strip().strip("|").split("|")] for row in rows]


def functions_in(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}


def references(cell: str, column_dir: Path) -> list[tuple[Path, str | None]]:
    """(file, test name or None) for each backticked name of one cell; ``::name`` reuses the cell's last file."""
    found: list[tuple[Path, str | None]] = []
    current: Path | None = None
    for file_part, name in REFERENCE.findall(cell):
        if file_part:
            if "/" in file_part:
                current = TESTS / file_part
            elif current is not None and (current.parent / file_part).is_file():
                current = current.parent / file_part
            else:
                current = column_dir / file_part
        if current is None:
            continue
        found.append((current, name or None))
    return found


def test_every_named_test_exists() -> None:
    missing = []
    count = 0
    for row in pinning_table():
        for cell, column_dir in zip(row[1:], COLUMN_DIRS, strict=False):
            for path, name in references(cell, column_dir):
                count += 1
                if not path.is_file():
                    missing.append(f"{row[0]}: no file {path.relative_to(REPO)}")
                elif name is not None and name not in functions_in(path):
                    missing.append(f"{row[0]}: no test {name} in {path.relative_to(REPO)}")
    assert count > 40, "the §9 table was not parsed"
    assert missing == []


def test_every_row_metric_has_a_pinning_test() -> None:
    table = pinning_table()
    numbered = {int(m.group(1)) for row in table if (m := re.match(r"(\d+) ", row[0]))}
    assert numbered == set(range(1, 11))
    for row in table:
        assert any(REFERENCE.search(cell) for cell in row[1:]), f"{row[0]} names no test"
