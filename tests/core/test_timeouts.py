"""No test can hang: pytest-timeout fails a test that sleeps forever, with a traceback, and the run goes on."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.conftest import CORE_TIMEOUT_S, REPO, UNIT_TIMEOUT_S, timeout_for

FOREVER = textwrap.dedent(
    """
    import time

    import pytest


    def test_sleeps_forever():
        while True:
            time.sleep(3600)


    @pytest.mark.timeout(1)
    def test_marked_sleeps_forever():
        while True:
            time.sleep(3600)


    def test_after_the_hangs_still_runs():
        assert True
    """
)


def test_a_test_that_sleeps_forever_fails_by_timeout(tmp_path):
    (tmp_path / "test_forever.py").write_text(FOREVER)
    # The repository's own pytest configuration (timeout method, markers), with the default limit lowered to 2 s.
    config = ["-c", str(REPO / "pyproject.toml"), "--rootdir", str(tmp_path), "-p", "no:cacheprovider"]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", *config, "-o", "timeout=2", "-v", str(tmp_path / "test_forever.py")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "test_sleeps_forever FAILED" in out and "test_marked_sleeps_forever FAILED" in out, out
    assert "test_after_the_hangs_still_runs PASSED" in out, out
    assert "Failed: Timeout (>2.0s) from pytest-timeout." in out, out
    assert "Failed: Timeout (>1.0s) from pytest-timeout." in out, out
    assert "time.sleep(3600)" in out  # the traceback shows where it hung


def test_unit_tests_get_tighter_limits_than_the_suite_default():
    assert timeout_for("tests/core/test_report.py", set()) == CORE_TIMEOUT_S == 60
    assert timeout_for("tests/engine/test_route_ahead.py", set()) == UNIT_TIMEOUT_S == 120
    assert timeout_for("tests/sweep/test_store.py", set()) == UNIT_TIMEOUT_S
    # Cluster, end-to-end and GPU tests, and tests whose fixtures may train a preset, keep the default.
    assert timeout_for("tests/sweep/test_cluster.py", {"ray"}) is None
    assert timeout_for("tests/engine/moe_infinity/test_fake_sweep.py", {"slow", "ray"}) is None
    assert timeout_for("tests/engine/reference/test_drafter.py", set()) is None
    assert timeout_for("tests/core/test_report.py", {"timeout"}) is None  # a test's own marker wins
    pyproject = (REPO / "pyproject.toml").read_text()
    assert "\ntimeout = 300\n" in pyproject and '\ntimeout_method = "signal"\n' in pyproject
