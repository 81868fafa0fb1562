"""Drafter parity with the official DFlash implementation (``dflash`` 0.1.0, z-lab), token for token.

The official package lives in its own environment (scripts/dflash_official_env.sh: pip would have to downgrade
two packages of the project's). Two ways in:

- always: the official outputs pinned in ``fixtures/dflash_official.json`` (made by
  ``python scripts/dflash_parity.py fixture --official-python <official env>/bin/python``) against pd-dflash on
  the same inputs, regenerated here from seeds (their digest must match the fixture's);
- when that environment exists (``PD_DFLASH_OFFICIAL_PYTHON``, default ``.cache/dflash-official/bin/python``):
  the official package run live on freshly written inputs.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO

FIXTURE = REPO / "tests" / "engine" / "reference" / "fixtures" / "dflash_official.json"


def _parity():
    spec = importlib.util.spec_from_file_location("dflash_parity", REPO / "scripts" / "dflash_parity.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


parity = _parity()


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash_parity") / "inputs"
    parity.write_inputs(root)
    return root


@pytest.fixture(scope="module")
def pinned():
    return json.loads(FIXTURE.read_text())


def test_the_fixture_was_made_from_these_inputs(inputs, pinned):
    assert parity.inputs_digest(inputs) == pinned["inputs_digest"], (
        "the parity inputs changed since the fixture was made: regenerate it with "
        "`python scripts/dflash_parity.py fixture --official-python <official env>/bin/python`"
    )


def test_the_fixture_exercises_acceptance_and_multi_row_contexts(pinned):
    """Not vacuous: the official loop accepted drafts somewhere (so later drafts see several new context rows)
    and the drafted blocks are not all one token."""
    for case in parity.CASES:
        loop = pinned["official"][case["name"]]["loop"]
        rounds = [len(p["drafts"]) for p in loop]
        assert min(rounds) < parity.MAX_NEW_TOKENS - 1, case["name"]
        assert len({t for p in loop for d in p["drafts"] for t in d}) > 3
    assert pinned["official"]["versions"]["dflash"] == "0.1.0"


@pytest.mark.parametrize("concurrency", [1, 3])
def test_drafted_blocks_match_the_official_implementation(inputs, pinned, concurrency):
    """c = 1: each prompt alone, as the official loop runs; c = 3: all drafted together in one forward."""
    problems = parity.compare(pinned["official"], parity.run_ours(inputs, concurrency=concurrency))
    assert not problems, "\n".join(problems[:5])


def _official_python() -> str | None:
    path = os.environ.get("PD_DFLASH_OFFICIAL_PYTHON") or str(
        REPO / ".cache" / "dflash-official" / "bin" / "python"
    )
    if not Path(path).exists():
        return None
    probe = subprocess.run([path, "-c", "import dflash.model"], capture_output=True, text=True)
    return path if probe.returncode == 0 else None


def test_live_parity_with_the_official_package(inputs, tmp_path):
    python = _official_python()
    if python is None:
        pytest.skip(
            "the official dflash environment is not installed (scripts/dflash_official_env.sh, or set "
            "PD_DFLASH_OFFICIAL_PYTHON); parity is still checked against the pinned fixture"
        )
    out = tmp_path / "official.json"
    subprocess.run(
        [python, str(REPO / "scripts" / "dflash_parity.py"), "official", str(inputs), str(out)], check=True
    )
    problems = parity.compare(json.loads(out.read_text()), parity.run_ours(inputs))
    assert not problems, "\n".join(problems[:5])
