"""The fixed names of a results directory are never followed out of it (pure: no Ray).

OUT itself may be a link the user chose; every name the sweep writes or reads inside it (``FILES``, ``DIRS``
and what ``errors/`` and ``plots/`` hold) must be what it says: a regular file or a real directory. A symbolic
link there (``OUT/.lock -> ~/.bashrc``) would have the sweep truncate, append to or remove a file outside OUT,
so it is refused, naming the link and its target, before anything in OUT is read or written: exit 2, nothing
outside touched. The writers also open their files ``O_NOFOLLOW`` (``rows.py``, ``store.py``), so a link made
while the sweep runs fails the write instead of being followed.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from pd_dflash.errors import InputError
from pd_dflash.rows import ROWS_FILE
from pd_dflash.sweep.resume import ARCHIVE_DIR, SWEEP_FILE

LOCK_FILE = ".lock"
EVENTS_FILE = "events.jsonl"
#: Where resume moves stored rows the report would refuse (one JSON object per row: line, reason, the text).
SET_ASIDE_FILE = "rows.set-aside.jsonl"
ERRORS_DIR = "errors"
PLOTS_DIR = "plots"
#: Every file the sweep writes under a fixed name (the matrices are ``staging.MATRIX_GLOBS``).
FILES = (
    LOCK_FILE,
    SWEEP_FILE,
    ROWS_FILE,
    f"{ROWS_FILE}.torn",
    EVENTS_FILE,
    f"{EVENTS_FILE}.torn",
    SET_ASIDE_FILE,
    "result_matrix.json",
    "result_matrix.csv",
    "result_matrix.md",
    "verdict.json",
)
#: Directories it writes into; every entry of the first two must be a regular file too.
DIRS = (ERRORS_DIR, PLOTS_DIR, ARCHIVE_DIR)


def check_out_names(out_dir: Path) -> None:
    """InputError naming the first fixed name of ``out_dir`` that is a link or not of its kind; nothing is
    changed. A missing name is fine (it is created as a regular file or directory)."""
    for name in FILES:
        _check(out_dir / name, stat.S_ISREG, "a regular file")
    for name in DIRS:
        if _check(out_dir / name, stat.S_ISDIR, "a directory") and name != ARCHIVE_DIR:
            for entry in sorted((out_dir / name).iterdir()):
                _check(entry, stat.S_ISREG, "a regular file")


def real_dir(path: Path) -> bool:
    """True when ``path`` is a directory and not a link to one (a folder the sweep may write into or glob)."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


def _check(path: Path, kind, what: str) -> bool:
    """True when ``path`` exists as ``kind``; False when it does not exist; else an InputError."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise InputError(f"cannot inspect it: {exc.strerror or exc}", where=str(path)) from None
    if kind(mode):
        return True
    if stat.S_ISLNK(mode):
        target = os.readlink(path)
        problem = (
            f"is a symbolic link (to {target}); the sweep never follows a name of its results directory out of "
            f"it. Remove the link (the sweep creates {what} there) or choose another --out"
        )
    else:
        problem = f"must be {what}; move it away or choose another --out"
    raise InputError(problem, where=str(path))


def refuse_link(exc: OSError, path: Path) -> InputError:
    """The InputError for an ``O_NOFOLLOW`` open that failed (ELOOP: a link), naming the path."""
    if exc.errno == errno.ELOOP:
        return InputError(
            "is a symbolic link; the sweep never follows a name of its results directory out of it. Remove "
            "the link or choose another --out",
            where=str(path),
        )
    return InputError(f"cannot open it: {exc.strerror or exc}", where=str(path))
