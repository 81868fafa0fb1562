"""Fixtures shared by the sweep tests."""

from __future__ import annotations

import shutil
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
