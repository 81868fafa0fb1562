"""``report`` without ``--spec`` on an adaptive sweep's rows: the design is read from the sweep.json beside them,
and rows that look adaptive with no design known are said to be so (docs/metrics.md §7f, issue 30)."""

from __future__ import annotations

import json
import subprocess
import sys

from pd_dflash.cli import main
from pd_dflash.rows import append_row
from pd_dflash.spec import parse_spec
from tests.core.helpers import base_spec
from tests.core.test_adaptive import AT_THRESHOLD, CLEAR, adaptive_spec, rows_until


def sweep_dir(tmp_path, spec, rows, name="sweep", record=True):
    """A sweep directory as the driver leaves it: rows.jsonl and (``record``) sweep.json with its spec."""
    folder = tmp_path / name
    folder.mkdir()
    for row in rows:
        append_row(folder / "rows.jsonl", row)
    if record:
        stored = {**spec.model_dump(mode="json"), "env": {"names": [], "values_sha256": "0" * 64}}
        (folder / "sweep.json").write_text(json.dumps({"name": spec.name, "spec": stored}))
    return folder


def report(capsys, *args) -> tuple[int, dict, str]:
    out = args[-1]
    code = main(["report", *map(str, args[:-1]), "--out", str(out)])
    err = capsys.readouterr().err
    return code, json.loads((out / "verdict.json").read_text()), err


def adaptive_rows():
    s = adaptive_spec(block_sizes=[8], concurrency=[1, 4])
    return s, rows_until(s, {1: 3, 4: 4}, {1: CLEAR, 4: AT_THRESHOLD})


def test_a_sweep_directory_is_reported_on_its_own_adaptive_design(tmp_path, capsys):
    s, rows = adaptive_rows()
    folder = sweep_dir(tmp_path, s, rows)
    with_spec = tmp_path / "spec.json"
    with_spec.write_text(
        json.dumps(
            base_spec(
                baselines=["B0", "B1", "B3", "OURS"],
                block_sizes=[8],
                concurrency=[1, 4],
                repeats={"min": 2, "max": 4},
            )
        )
    )
    code, found, err = report(capsys, folder, tmp_path / "found")
    given_code, given, _ = report(capsys, folder / "rows.jsonl", "--spec", with_spec, tmp_path / "given")
    assert code == given_code
    assert "adaptive repeats design read from" in err and "sweep.json" in err
    assert found["adaptive"]["rule"].startswith("Bonferroni")
    assert found["groups"]["micro|B8|c4"]["adaptive"]["stop"] == "max reached"
    assert found["groups"]["micro|B8|c1"]["adaptive"]["stop"] == "decided"
    assert found["confidence"] == given["confidence"] and found["adaptive"] == given["adaptive"]
    assert "95% intervals" not in found["overall"]["line"] and "WARNING" not in found["overall"]["line"]
    # rows.jsonl named directly finds the same record beside it
    _, direct, _ = report(capsys, folder / "rows.jsonl", tmp_path / "direct")
    assert direct["confidence"] == found["confidence"]


def test_rows_that_look_adaptive_without_a_design_say_so_loudly(tmp_path, capsys):
    s, rows = adaptive_rows()
    folder = sweep_dir(tmp_path, s, rows, record=False)
    _, verdict, err = report(capsys, folder, tmp_path / "o")
    warning = verdict["confidence"]["design_warning"]
    assert warning.startswith(
        "WARNING: repeat counts differ between groups (3 in micro|B8|c1, 4 in micro|B8|c4)"
    )
    assert "no sweep.json beside the rows" in warning and "--spec" in warning
    assert warning in verdict["overall"]["line"] and warning in err
    assert warning in (tmp_path / "o" / "result_matrix.md").read_text()
    assert "adaptive" not in verdict


def test_a_corrupt_or_mismatched_record_leaves_the_design_unknown(tmp_path, capsys):
    s, rows = adaptive_rows()
    folder = sweep_dir(tmp_path, s, rows)
    (folder / "sweep.json").write_text("{torn")
    _, verdict, _ = report(capsys, folder, tmp_path / "o")
    assert "unreadable (JSONDecodeError)" in verdict["confidence"]["design_warning"]
    other = adaptive_spec(block_sizes=[8], concurrency=[1, 4], repeats={"min": 2, "max": 5})
    sweep_dir(tmp_path, s, [r for r in rows if r.concurrency == 1], name="c1")
    sweep_dir(tmp_path, other, [r for r in rows if r.concurrency == 4], name="c4")
    _, mixed, _ = report(capsys, tmp_path / "c1", tmp_path / "c4" / "rows.jsonl", tmp_path / "m")
    assert "hold different specs" in mixed["confidence"]["design_warning"]


def test_fixed_repeat_rows_are_reported_as_before(tmp_path, capsys):
    """Equal repeat counts: no warning, with or without a record; a fixed record beside rows changes nothing."""
    s = parse_spec(
        base_spec(baselines=["B0", "B1", "B3", "OURS"], block_sizes=[8], concurrency=[1, 4], repeats=3)
    )
    rows = rows_until(
        adaptive_spec(block_sizes=[8], concurrency=[1, 4]), {1: 3, 4: 3}, {1: CLEAR, 4: AT_THRESHOLD}
    )
    bare = sweep_dir(tmp_path, s, rows, name="bare", record=False)
    recorded = sweep_dir(tmp_path, s, rows, name="recorded")
    _, a, _ = report(capsys, bare, tmp_path / "a")
    _, b, _ = report(capsys, recorded, tmp_path / "b")
    assert "design_warning" not in a["confidence"] and "adaptive" not in a
    assert a == b and "on 95% intervals" in a["overall"]["line"]
    # a fixed design's partial rows (counts differ, but the record says fixed): no warning either
    part = sweep_dir(tmp_path, s, rows[: len(rows) - 3], name="part")
    _, c, _ = report(capsys, part, tmp_path / "c")
    assert "design_warning" not in c["confidence"]


def test_report_still_imports_neither_torch_nor_ray(tmp_path):
    s, rows = adaptive_rows()
    folder = sweep_dir(tmp_path, s, rows)
    code = (
        "import sys; from pd_dflash.cli import main; "
        f"main(['report', {str(folder)!r}, '--out', {str(tmp_path / 'o')!r}]); "
        "assert 'torch' not in sys.modules and 'ray' not in sys.modules, sorted(sys.modules)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
