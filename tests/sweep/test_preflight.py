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


def test_a_link_rate_ablation_is_checked_rate_by_rate_on_the_box():
    """A list of emulated link rates (an ablation axis) is each checked as an engine option, not as one value."""
    from pd_dflash.spec import ModelSpec
    from pd_dflash.sweep.preflight import check_engine_importable

    ok = ModelSpec(id="micro", preset="micro", engine_options={"emulated_h2d_gbps": [0.03, 0.1]})
    assert check_engine_importable("reference", {}, [ok])["ok"]
    bad = ModelSpec(id="micro", preset="micro", engine_options={"emulated_h2d_gbps": [0.03, -1.0]})
    result = check_engine_importable("reference", {}, [bad])
    assert not result["ok"] and "emulated_h2d_gbps" in result["error"]
