"""The result matrices of a sweep directory, written as one set (pure: no Ray).

``report.write_outputs`` writes each file atomically, but one after the other: a write that fails half-way (a full
disk) would leave a new ``result_matrix.json`` beside an old ``result_matrix.md``, a set that agrees neither with
itself nor with the rows. Here the report writes into a hidden staging directory inside OUT (same filesystem), and
only when every file is there are they renamed into place. When a file cannot be written, the error names it and
the previous matrices are removed too — they describe fewer rows than are stored, and ``pd-dflash report`` rebuilds
them from rows.jsonl — so OUT never holds a stale or partial ``result_matrix.*`` beside its rows.
"""

from __future__ import annotations

import errno
import os
import secrets
import shutil
from pathlib import Path
from typing import Any

from pd_dflash.rows import fsync_dir
from pd_dflash.schema import Row
from pd_dflash.spec import SweepSpec
from pd_dflash.sweep.out_names import real_dir

#: What the report writes into OUT (plots/ only with plots); all of it is removed when a write fails.
MATRIX_GLOBS = ("result_matrix.*", "verdict.json", "plots/*.png")


class MatrixWriteError(RuntimeError):
    """A result matrix could not be written: names the file; the previous matrices were removed."""


def write_matrix_set(
    rows: list[Row], out_dir: Path, spec: SweepSpec, *, plots: bool = False
) -> dict[str, Any]:
    """Write every output of ``report.write_outputs`` for ``rows`` into OUT as one set; return the verdict."""
    from pd_dflash.report import write_outputs

    stage = (
        out_dir / f".matrices.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    )  # removed at open if a crash left it
    try:
        try:
            stage.mkdir(mode=0o750)
            verdict = write_outputs(rows, stage, spec.gates, plots=plots, spec=spec)
            staged = sorted(p.relative_to(stage) for p in stage.rglob("*") if p.is_file())
            for name in staged:  # renames need no space: once every file is written, the set goes in whole
                folder = (out_dir / name).parent
                folder.mkdir(mode=0o750, exist_ok=True)
                if not real_dir(folder):  # plots/ made a link meanwhile: never write through it out of OUT
                    raise OSError(errno.ELOOP, "not a directory of OUT (a link?)", str(folder))
                os.replace(stage / name, out_dir / name)
        except OSError as exc:
            raise _failed(exc, stage, out_dir) from None
        for folder in {(out_dir / name).parent for name in staged}:
            fsync_dir(folder)
        return verdict
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _failed(exc: OSError, stage: Path, out_dir: Path) -> MatrixWriteError:
    """The error of a failed write, naming the file as it would have been in OUT, after removing the old set."""
    where = Path(exc.filename) if exc.filename else None
    if where is not None and stage in where.parents:
        name = where.relative_to(stage)
        if name.name.startswith(".") and ".tmp-" in name.name:  # the atomic write's temporary file
            name = name.with_name(name.name[1:].split(".tmp-")[0])
        where = out_dir / name
    elif where == stage:
        where = None  # the staging directory itself could not be made
    removed = remove_matrices(out_dir)
    what = f" (removed the previous {', '.join(removed)})" if removed else ""
    return MatrixWriteError(
        f"cannot write {where or 'the result matrices'}: {exc.strerror or exc} (errno {exc.errno}); no result "
        f"matrix is left in {out_dir}{what}; `pd-dflash report {out_dir} --out {out_dir} --spec SPEC` rebuilds them from "
        "the rows",
    )


def remove_matrices(out_dir: Path) -> list[str]:
    """Remove what the report wrote into OUT (``MATRIX_GLOBS``); returns the names removed."""
    removed = []
    for pattern in MATRIX_GLOBS:
        if "/" in pattern and not real_dir(out_dir / pattern.split("/")[0]):
            continue  # never glob through a link out of OUT
        for path in sorted(out_dir.glob(pattern)):
            if path.is_file():
                path.unlink(missing_ok=True)
                removed.append(str(path.relative_to(out_dir)))
    return removed
