"""cluster.yaml: valid for Ray's cluster launcher, and its `ray start` commands survive YAML and the shell."""

from __future__ import annotations

import copy
import json
import os
import stat
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.sweep.helpers import REPO

CONFIG = REPO / "cluster.yaml"


def test_cluster_yaml_passes_the_launchers_own_validation():
    util = pytest.importorskip("ray.autoscaler._private.util")
    config = yaml.safe_load(CONFIG.read_text())
    prepared = util.prepare_config(copy.deepcopy(config))  # what `ray up` does first
    util.validate_config(prepared)
    assert config["provider"]["type"] == "local"
    assert config["provider"]["head_ip"] and config["provider"]["worker_ips"]
    assert "available_node_types" not in config  # rejected for on-prem clusters
    assert prepared["available_node_types"]["local.cluster.node"]["max_workers"] == len(
        config["provider"]["worker_ips"]
    )


def _fake_bin(tmp: Path, name: str, body: str) -> None:
    path = tmp / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


@pytest.mark.parametrize("section", ["head_start_ray_commands", "worker_start_ray_commands"])
def test_ray_start_commands_give_ray_the_custom_resource_and_token_auth(tmp_path, section):
    """Run the commands in bash with stand-ins for nvidia-smi and ray that record what they were given."""
    home = tmp_path / "home"
    venv_bin = home / "pd-dflash-venv" / "bin"
    venv_bin.mkdir(parents=True)
    calls = tmp_path / "calls.jsonl"
    _fake_bin(
        tmp_path,
        "nvidia-smi",
        'printf "NVIDIA RTX PRO 6000 Blackwell Server Edition\\n%.0s" 1 2 3 4\n',
    )
    _fake_bin(
        venv_bin,
        "ray",
        f'python3 -c \'import json, os, sys; print(json.dumps({{"argv": sys.argv[1:], '
        f'"auth": os.environ.get("RAY_AUTH_MODE")}}))\' "$@" >> {calls}\n',
    )
    config = yaml.safe_load(CONFIG.read_text())
    env = {
        **os.environ,
        "HOME": str(home),
        "PATH": f"{tmp_path}:{os.environ['PATH']}",
        "RAY_HEAD_IP": "10.0.0.1",
    }
    env.pop("RAY_AUTH_MODE", None)
    for command in config[section]:
        subprocess.run(["bash", "-c", command], env=env, check=True, capture_output=True, timeout=30)
    recorded = [json.loads(line) for line in calls.read_text().splitlines()]
    assert recorded[0]["argv"] == ["stop"]
    start = recorded[-1]
    assert start["argv"][0] == "start" and start["auth"] == "token"
    resources = next(a for a in start["argv"] if a.startswith("--resources="))
    assert json.loads(resources.split("=", 1)[1]) == {"rtx_pro_6000": 4}
    if section == "head_start_ray_commands":
        assert "--head" in start["argv"] and "--port=6379" in start["argv"]
    else:
        assert "--address=10.0.0.1:6379" in start["argv"]
