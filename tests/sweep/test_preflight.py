"""Preflight decisions that need no cluster: token authentication of a cluster run."""

from __future__ import annotations

import pytest

from pd_dflash.sweep.preflight import PreflightError, check_auth


def test_a_cluster_run_needs_token_auth_or_insecure():
    assert check_auth("token", insecure=False) is None
    assert check_auth("token", insecure=True) is None
    with pytest.raises(PreflightError, match="without token authentication") as err:
        check_auth("disabled", insecure=False)
    assert (
        err.value.exit_code == 2
        and "--insecure" in str(err.value)
        and "RAY_AUTH_MODE=token" in str(err.value)
    )
    warning = check_auth("disabled", insecure=True)
    assert warning.startswith("WARNING:") and "RAY_AUTH_MODE=disabled" in warning
