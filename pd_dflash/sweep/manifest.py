"""The environment manifest stored with every row and in sweep.json (pure: imports neither torch nor Ray).

Package versions come from installed distribution metadata, so asking for torch's version never imports it.
The spec's ``env`` is applied on the runners but never written: outputs record its variable names and one hash
of the values (``env_summary``), and ``redact`` removes values that an engine or an error message echoed.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import socket
import subprocess
import sys
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Any

import pd_dflash

#: Distributions whose versions change measurements or orchestration.
PACKAGES = (
    "torch",
    "transformers",
    "ray",
    "pydantic",
    "nvidia-ml-py",
    "nvtx",
    "moe-infinity",
    "safetensors",
    "pandas",
)


def package_versions(names: tuple[str, ...] = PACKAGES) -> dict[str, str]:
    """Installed versions of the named distributions; absent ones are left out."""
    found = {}
    for name in names:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


@lru_cache(maxsize=1)
def git_revision() -> str | None:
    """The checkout's commit (with ``-dirty`` when it has local changes), or None outside a git checkout."""
    root = Path(pd_dflash.__file__).resolve().parents[1]
    try:
        rev = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5
        )
        if rev.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return rev.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


#: Values shorter than this are not searched for in recorded text: a secret is longer, and a short value
#: ("1", "0") would match unrelated data (GPU ids, counts).
MIN_REDACTED_LENGTH = 8


def env_summary(env: dict[str, str]) -> dict[str, Any]:
    """What outputs record of the spec's env: the names, and a hash that changes when any value does."""
    digest = hashlib.sha256(json.dumps(sorted(env.items())).encode()).hexdigest()
    return {"names": sorted(env), "values_sha256": digest}


def redact(value: Any, env: dict[str, str]) -> Any:
    """``value`` with every occurrence of a spec env value (of ``MIN_REDACTED_LENGTH`` or more characters)
    replaced by ``<env NAME>``, in strings nested in dicts and lists."""
    found = [(v, k) for k, v in env.items() if len(v) >= MIN_REDACTED_LENGTH]
    secrets = sorted(
        found, key=lambda pair: len(pair[0]), reverse=True
    )  # a value inside another: longest first
    return _redact(value, secrets) if secrets else value


def _redact(value: Any, secrets: list[tuple[str, str]]) -> Any:
    if isinstance(value, str):
        for secret, name in secrets:
            if secret in value:
                value = value.replace(secret, f"<env {name}>")
        return value
    if isinstance(value, dict):
        return {k: _redact(v, secrets) for k, v in value.items()}
    if isinstance(value, list):
        return [_redact(v, secrets) for v in value]
    return value


def environment_manifest(env: dict[str, str] | None = None) -> dict[str, Any]:
    """Host, Python, package versions, git revision and a summary of the spec's environment variables."""
    manifest: dict[str, Any] = {
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "python_executable": sys.executable,
        "pd_dflash": pd_dflash.__version__,
        "packages": package_versions(),
        "cpu_count": os.cpu_count(),
    }
    rev = git_revision()
    if rev:
        manifest["git_revision"] = rev
    if env:
        manifest["spec_env"] = env_summary(env)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        manifest["cuda_visible_devices"] = visible
    return manifest
