"""Fixtures shared by the sweep tests."""

from __future__ import annotations

import shutil
import signal
import tempfile

import pytest

from tests.sweep.helpers import kill_pids, make_spec, processes_using


@pytest.fixture
def ray_tmp():
    """A short private Ray temp dir (unix socket paths are limited to 107 bytes); everything in it is ours."""
    path = tempfile.mkdtemp(prefix="pdr", dir="/tmp")
    yield path
    kill_pids(processes_using(path))
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def spec():
    """The 12-cell sweep of the test engines (``helpers.spec_data``), for tests that need its cells only."""
    return make_spec()


@pytest.fixture
def hangup_default():
    """SIGHUP at its default while the test runs: a suite started under ``nohup`` passes SIG_IGN on, and a
    driver that starts with SIGHUP ignored keeps ignoring it by design (the test sets what it relies on)."""
    previous = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        yield
    finally:
        signal.signal(signal.SIGHUP, previous)
