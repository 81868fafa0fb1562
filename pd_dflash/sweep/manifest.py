"""The environment manifest stored with every row and in sweep.json (pure: imports neither torch nor Ray).

Package versions come from installed distribution metadata, so asking for torch's version never imports it.
"""

from __future__ import annotations

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


def environment_manifest(env: dict[str, str] | None = None) -> dict[str, Any]:
    """Host, Python, package versions, git revision and the spec's environment variables of this process."""
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
        manifest["spec_env"] = dict(env)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        manifest["cuda_visible_devices"] = visible
    return manifest
