"""Finding a checkpoint offline (no torch, no network): ``models[].path``, a local directory, a built-in tiny
real-layout checkpoint, or a hub id already in the Hugging Face cache under ``HF_HOME``.

The hub cache layout is ``$HF_HUB_CACHE`` (default ``$HF_HOME/hub``, ``HF_HOME`` default
``~/.cache/huggingface``) / ``models--{org}--{name}`` / ``snapshots/{revision}``, the revision named by
``refs/main``. Resolution is read-only; nothing is downloaded.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from pd_dflash.engine.reference.families import FAMILIES
from pd_dflash.errors import InputError, excerpt

#: Tiny random checkpoints in the real layouts (one per family that writes one), generated into the engine's
#: cache on first use (``checkpoints.tiny``) and then loaded like any other checkpoint.
TINY_REAL = tuple(f.tiny_name for f in FAMILIES.values() if f.tiny_name)


@dataclass(frozen=True)
class Resolved:
    #: The checkpoint directory, or None when it is not on this machine.
    directory: Path | None
    #: "path" (models[].path), "local" (id is a directory), "hub-cache", "tiny-real", or "missing".
    source: str
    #: Where it was looked for (for the error message when missing).
    tried: tuple[str, ...] = ()
    #: The spec field the location came from.
    field: str = "models[].id"
    #: Why ``models[].path`` is not a checkpoint directory here: "does not exist" or "is not a directory".
    problem: str | None = None


def hub_cache(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"]).expanduser()
    home = env.get("HF_HOME") or str(Path.home() / ".cache" / "huggingface")
    return Path(home).expanduser() / "hub"


def hub_snapshot(repo_id: str, env: Mapping[str, str] | None = None) -> tuple[Path | None, Path]:
    """(snapshot directory or None, the repo's cache directory) of a hub id in the local cache."""
    repo = hub_cache(env) / ("models--" + repo_id.replace("/", "--"))
    ref = repo / "refs" / "main"
    if ref.is_file():
        snap = repo / "snapshots" / _revision(ref)
        if snap.is_dir():
            return snap, repo
    snaps = sorted(p for p in (repo / "snapshots").glob("*") if p.is_dir()) if repo.is_dir() else []
    return (snaps[-1] if len(snaps) == 1 else None), repo


def _revision(ref: Path) -> str:
    """The revision a hub cache's ``refs/main`` names: one plain directory name (a commit hash)."""
    try:
        with open(ref, "rb") as fh:
            text = fh.read(257).decode("utf-8").strip()
    except (OSError, UnicodeDecodeError):
        text = ""
    if not text or len(text) > 256 or Path(text).name != text or text in (".", ".."):
        raise InputError(
            f"not a revision name (expected a commit hash): {excerpt(text) if text else 'unreadable or empty'}",
            where=str(ref),
        )
    return text


def resolve(
    model_id: str,
    path: str | None = None,
    *,
    env: Mapping[str, str] | None = None,
    tiny_root: Path | None = None,
) -> Resolved:
    """Where the checkpoint of ``models[].id`` / ``models[].path`` is (``tiny_root``: the engine cache's
    checkpoint directory, for the tiny real-layout names)."""
    if path:
        p = Path(path).expanduser()
        if p.is_dir():
            return Resolved(p, "path", (str(p),), "models[].path")
        problem = "is not a directory" if p.exists() else "does not exist"
        return Resolved(None, "missing", (str(p),), "models[].path", problem)
    if model_id in TINY_REAL:
        root = tiny_root or Path("<cache>/checkpoints")
        return Resolved(root / model_id, "tiny-real", (str(root / model_id),))
    local = Path(model_id).expanduser()
    if local.is_dir():
        return Resolved(local, "local", (str(local),))
    tried = [str(local)]
    if model_id.count("/") == 1 and not model_id.startswith((".", "/", "~")):
        snap, repo = hub_snapshot(model_id, env)
        tried.append(str(repo))
        if snap is not None:
            return Resolved(snap, "hub-cache", tuple(tried))
    return Resolved(None, "missing", tuple(tried))
