"""`pd-dflash run` argument and input checks that need no cluster. The local-mode end-to-end run (a single-node
Ray cluster with fake GPUs started by the command itself) is in test_kill_resume.py, whose resumed run checks
the complete matrix."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pd_dflash.cli import build_parser
from pd_dflash.errors import InputError
from pd_dflash.schema import Row
from pd_dflash.spec import expand, parse_spec
from pd_dflash.sweep.cli import options_from_args
from pd_dflash.sweep.resume import Mode
from pd_dflash.sweep.store import SweepStore
from tests.sweep.engines import synthetic_result
from tests.sweep.helpers import REPO, run_cli, spec_data, stored_rows, write_spec


def test_a_changed_spec_is_refused_before_any_cluster_starts(tmp_path):
    data = spec_data()
    spec = parse_spec(data)
    out = tmp_path / "out"
    store = SweepStore(out, spec, Mode.RESUME)
    store.open()
    cell = expand(spec)[0]
    store.add(Row.from_result(cell, synthetic_result(cell, 4, 0.1), sweep=spec.name))
    store.close()
    changed_data = {**data, "concurrency": [1, 2, 4]}
    changed = write_spec(tmp_path / "changed.yaml", changed_data)
    proc = run_cli("run", str(changed), "--out", str(out))
    assert proc.returncode == 2
    assert spec.fingerprint() in proc.stderr and parse_spec(changed_data).fingerprint() in proc.stderr
    assert "--restart" in proc.stderr
    assert "Started a local Ray instance" not in proc.stderr + proc.stdout
    assert len(stored_rows(out)) == 1  # nothing written was lost


def test_run_arguments_are_checked():
    parse = build_parser().parse_args
    assert options_from_args(parse(["run", "s.yaml", "--out", "o"])).mode == Mode.RESUME
    assert (
        options_from_args(parse(["run", "s.yaml", "--out", "o", "--retry-errors"])).mode == Mode.RETRY_ERRORS
    )
    opts = options_from_args(parse(["run", "s.yaml", "--out", "o", "--restart", "--cell-timeout", "5"]))
    assert opts.mode == Mode.RESTART and opts.cell_timeout_s == 5
    assert not opts.insecure
    assert options_from_args(parse(["run", "s.yaml", "--out", "o", "--insecure"])).insecure
    for flag, bad in (
        ("--max-attempts", "0"),
        ("--cell-timeout", "-1"),
    ):  # refused at parse (test_cli_bounds)
        with pytest.raises(SystemExit):
            parse(["run", "s.yaml", "--out", "o", flag, bad])
    args = parse(["run", "s.yaml", "--out", "o"])
    args.max_attempts = 0  # a Namespace built by hand is checked again
    with pytest.raises(InputError, match="--max-attempts"):
        options_from_args(args)


def test_a_bad_spec_exits_2_without_importing_ray(tmp_path):
    bad = write_spec(tmp_path / "bad.yaml", spec_data(concurrency=[0]))
    code = (
        "import sys; from pd_dflash.cli import main; "
        f"rc = main(['run', {str(bad)!r}, '--out', {str(tmp_path / 'out')!r}]); "
        "print('ray imported' if 'ray' in sys.modules else 'ray not imported'); sys.exit(rc)"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 2 and "concurrency.0" in proc.stderr
    assert "ray not imported" in proc.stdout


def test_phase_a_entrypoint_requires_an_absolute_out(tmp_path):
    proc = subprocess.run(
        [sys.executable, "jobs/phase_a.py", "--spec", "jobs/phase_a.yaml", "--out", "relative/dir"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "absolute" in proc.stderr


def test_the_make_run_spec_plans_every_configuration():
    from pd_dflash.plan import plan
    from pd_dflash.spec import load_spec

    spec = load_spec(REPO / "jobs" / "cpu_reference.yaml")
    planned = plan(spec)
    assert planned["counts"]["blocked"] == 0 and spec.engine == "reference"
    assert set(spec.baselines) == {"B0", "B1", "B2", "B3", "OURS"} and spec.hardware.device == "cpu"
