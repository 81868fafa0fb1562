"""Artifacts built once and cached on disk (trained presets and drafters, tiny checkpoints): where the cache is,
the key part that changes with the code that makes them, and building each one once across processes.

Below every room that caches something (``presets/``, ``dflash/``, ``checkpoints/``), so none imports another's.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def code_version(files: tuple[str, ...]) -> str:
    """Hash of the source files (relative to ``engine/reference/``) that determine a cached artifact (and torch's
    version): the cache key part."""
    here = Path(__file__).parent
    h = hashlib.sha256()
    for name in files:
        h.update((here / name).read_bytes())
    h.update(torch.__version__.split("+")[0].encode())
    return h.hexdigest()[:12]


def cache_root(cache_dir: str | None = None) -> Path:
    """engine_options.cache_dir, else $PD_DFLASH_CACHE, else ~/.cache/pd-dflash."""
    root = cache_dir or os.environ.get("PD_DFLASH_CACHE") or str(Path.home() / ".cache" / "pd-dflash")
    return Path(root).expanduser()


def build_once(path: Path, build: Callable[[Path], dict[str, Any]]) -> bool:
    """Build a cached artifact directory once across processes; True when this call built it.

    Runners on one box may ask for the same preset at once: an fcntl lock serialises them, ``build`` writes the
    artifact into a temporary directory and returns its card, and the directory is published with an atomic
    rename. ``card.json``, written last, marks a complete artifact.
    """
    if (path / "card.json").exists():
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f"{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (path / "card.json").exists():
            return False
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
        try:
            card = build(tmp)
            (tmp / "card.json").write_text(json.dumps(card, indent=2, sort_keys=True) + "\n")
            if path.exists():  # a half-written directory from a crashed run (no card.json)
                shutil.rmtree(path)
            os.replace(tmp, path)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return True
