"""Shared test settings. Ray tests must never leave a token behind or phone home; nothing is downloaded."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Trained reference presets are deterministic and cached; keep the cache inside the checkout (git-ignored).
os.environ.setdefault("PD_DFLASH_CACHE", str(REPO / ".cache" / "pd-dflash"))

# -- per-test time limits (pytest-timeout; the suite-wide default is `timeout` in pyproject.toml) ----------
#: Pure core tests: milliseconds each; the slowest (a subprocess that imports the CLI) takes seconds.
CORE_TIMEOUT_S = 60
#: Other unit tests (no cluster, no end-to-end run): a subprocess or a tiny torch model at most.
UNIT_TIMEOUT_S = 120
#: Markers of tests that keep the generous default: they start clusters or processes, or need a GPU.
SLOW_MARKERS = ("ray", "slow", "gpu")
#: Directories whose session fixtures may train a preset or a drafter on a fresh cache (about a minute).
TRAINING_DIRS = ("tests/engine/reference",)


def timeout_for(relpath: str, markers: set[str]) -> int | None:
    """The limit a test gets from this file, or None to keep pyproject's default (or its own marker)."""
    if "timeout" in markers or markers & set(SLOW_MARKERS) or not relpath.startswith("tests/"):
        return None
    if any(relpath.startswith(d + "/") for d in TRAINING_DIRS):
        return None
    return CORE_TIMEOUT_S if relpath.startswith("tests/core/") else UNIT_TIMEOUT_S


def pytest_ignore_collect(collection_path, config):
    """``pytest -m gpu`` on a CUDA box without Ray (the lent GPU image): tests/sweep imports Ray at module level
    and holds no gpu test, so it is not collected there (elsewhere a missing Ray still fails loudly)."""
    import importlib.util

    if collection_path == REPO / "tests" / "sweep" and config.getoption("markexpr", "") == "gpu":
        return importlib.util.find_spec("ray") is None or None
    return None


def pytest_collection_modifyitems(config, items):
    import pytest

    if config.getoption("timeout", None) is not None:  # an explicit --timeout wins everywhere
        return
    for item in items:
        try:
            relpath = Path(str(item.path)).resolve().relative_to(REPO).as_posix()
        except ValueError:
            continue
        limit = timeout_for(relpath, {m.name for m in item.iter_markers()})
        if limit is not None:
            item.add_marker(pytest.mark.timeout(limit))
