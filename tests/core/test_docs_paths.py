"""The docs name files that exist: a repository path in README.md, DEVELOPERS.md or docs/ is one ``ls`` finds,
unless its line says it is another commit's (``git worktree add … COMMIT``) or another project's (``@COMMIT``);
the mutant names docs/testing.md judges are of modules that exist, unless the row says which commit it records."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", REPO / "DEVELOPERS.md", *sorted((REPO / "docs").glob("*.md"))]
PATH = re.compile(
    r"\b(?:pd_dflash|tests|benchmarks|scripts|jobs|docs)/[\w./-]*\w\.(?:py|md|yaml|sh|toml|json)\b"
)
ELSEWHERE = re.compile(r"git worktree add|@[0-9a-f]{7,40}\b")
MUTANT = re.compile(r"^\|\s*`(pd_dflash(?:\.\w+)+?)\.x[^`]*__mutmut_\d+`")


def test_every_repository_path_the_docs_name_exists():
    missing = []
    for doc in DOCS:
        for n, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
            if ELSEWHERE.search(line):
                continue
            missing += [f"{doc.name}:{n} {p}" for p in PATH.findall(line) if not (REPO / p).exists()]
    assert not missing, "docs name paths that do not exist"


def test_the_judged_mutants_are_of_modules_that_exist():
    gone = []
    for n, line in enumerate((REPO / "docs" / "testing.md").read_text(encoding="utf-8").splitlines(), 1):
        m = MUTANT.match(line)
        if m and "recorded at" not in line:
            module = REPO / m[1].replace(".", "/")
            if not (module.with_suffix(".py").exists() or (module / "__init__.py").exists()):
                gone.append(f"testing.md:{n} {m[1]}")
    assert not gone, "docs/testing.md judges mutants of modules that no longer exist"
