"""No name of a results directory is followed out of it (issue 29 item 3): ``OUT/.lock`` as a link to a file
outside OUT used to truncate that file. Every fixed name (the lock, sweep.json, rows.jsonl, events, the torn and
set-aside files, the matrices, errors/, plots/, archive/ and what errors/ and plots/ hold) that is a link, or
not of its kind, is refused naming it, before anything is read or written: exit 2, nothing outside touched. A
link made while the store holds OUT fails the write (StorageError, the sweep stops) instead of being followed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pd_dflash.errors import InputError
from pd_dflash.sweep.out_names import DIRS, FILES
from pd_dflash.sweep.resume import Mode
from pd_dflash.sweep.staging import MatrixWriteError
from pd_dflash.sweep.store import StorageError, SweepStore
from tests.sweep.helpers import REPO, failed_row, ok_row, spec_data, write_spec


def snapshot(root: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under ``root`` with its content and mtime (what "nothing outside touched" compares)."""
    return {
        str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in root.rglob("*")
        if p.is_file()
    }


@pytest.fixture
def outside(tmp_path):
    """A directory outside OUT with a file worth keeping in it."""
    where = tmp_path / "outside"
    where.mkdir()
    (where / "precious.txt").write_text("keep me\n")
    (where / "precious.png").write_bytes(b"\x89PNG keep")
    return where


def sweep_dir(tmp_path: Path, spec) -> Path:
    """OUT with a stored row, its record and matrices (a resumable sweep directory)."""
    out = tmp_path / "out"
    store = SweepStore(out, spec, Mode.RESUME)
    store.open()
    cell = next(iter(store.cells.values()))
    store.add(ok_row(cell))
    store.write_matrices()
    store.close()
    return out


LINKED = [*FILES, *DIRS, "errors/c.txt", "plots/p.png", "dangling"]


@pytest.mark.parametrize("mode", [Mode.RESUME, Mode.RESTART])
@pytest.mark.parametrize("name", LINKED)
def test_a_fixed_name_that_links_out_of_out_is_refused_and_nothing_outside_is_touched(
    tmp_path, outside, spec, name, mode
):
    out = sweep_dir(tmp_path, spec)
    if name in ("errors/c.txt", "plots/p.png"):
        (out / name).parent.mkdir(exist_ok=True)
    target = outside if name in DIRS else outside / "precious.txt"
    link = out / name
    if name == "dangling":  # a link to a file that does not exist: O_CREAT would create it outside OUT
        link, target = out / ".lock", outside / "created.txt"
    link.unlink(missing_ok=True)
    if link.is_dir():
        import shutil

        shutil.rmtree(link)
    link.symlink_to(target)
    before = snapshot(outside)
    with pytest.raises(InputError) as err:
        SweepStore(out, spec, mode).open()
    assert str(link) in str(err.value) and "symbolic link" in str(err.value) and str(target) in str(err.value)
    assert snapshot(outside) == before
    assert not (outside / "created.txt").exists()
    assert link.is_symlink()  # the link itself is left for the user to look at


@pytest.mark.parametrize("name", ["rows.jsonl", ".lock", "sweep.json", "errors", "plots/p.png"])
def test_a_fixed_name_of_the_wrong_kind_is_refused(tmp_path, spec, name):
    out = sweep_dir(tmp_path, spec)
    path = out / name
    if name in ("errors",):
        path.write_text("a file where a directory belongs\n")
    else:
        path.parent.mkdir(exist_ok=True)
        path.unlink(missing_ok=True)
        if name == ".lock":
            os.mkfifo(path)
        else:
            path.mkdir()
    with pytest.raises(InputError) as err:
        SweepStore(out, spec, Mode.RESUME).open()
    assert str(path) in str(err.value) and "must be a" in str(err.value)


def test_a_link_made_while_the_store_holds_out_fails_the_write_instead_of_being_followed(
    tmp_path, outside, spec
):
    out = sweep_dir(tmp_path, spec)
    store = SweepStore(out, spec, Mode.RESUME)
    store.open()
    before = snapshot(outside)
    (out / "events.jsonl").unlink(missing_ok=True)
    (out / "events.jsonl").symlink_to(outside / "precious.txt")
    with pytest.raises(StorageError, match=r"events\.jsonl"):
        store.add_event({"event": "x"})
    assert snapshot(outside) == before
    store.close()

    store = SweepStore(out, spec, Mode.RESUME)
    (out / "events.jsonl").unlink()
    store.open()
    (out / "errors").mkdir(exist_ok=True)
    os.rename(out / "errors", tmp_path / "errors-moved")
    (out / "errors").symlink_to(outside)
    cell = list(store.cells.values())[1]
    with pytest.raises(StorageError, match="errors"):
        store.add(failed_row(cell), "Traceback: boom")
    assert snapshot(outside) == before
    store.close()

    store = SweepStore(out, spec, Mode.RESUME)
    (out / "errors").unlink()
    store.open()
    (out / "plots").symlink_to(outside)
    with pytest.raises(MatrixWriteError):
        store.write_matrices(plots=True)
    assert snapshot(outside) == before
    store.close()


def test_run_refuses_a_linked_lock_with_exit_2_before_any_cluster_starts(tmp_path, outside):
    spec = write_spec(tmp_path / "spec.yaml", spec_data())
    out = tmp_path / "out"
    out.mkdir()
    (out / ".lock").symlink_to(outside / "precious.txt")
    before = snapshot(outside)
    proc = subprocess.run(
        [sys.executable, "-m", "pd_dflash", "run", str(spec), "--out", str(out), "--no-progress"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"{out / '.lock'}: is a symbolic link (to {outside / 'precious.txt'})" in proc.stderr
    assert snapshot(outside) == before
    assert sorted(p.name for p in out.iterdir()) == [".lock"]  # nothing written in OUT either
