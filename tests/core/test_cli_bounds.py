"""Every number the command line takes is bounded at parse with its limits named (exit 2, no traceback: a
``--connect-timeout 1e308`` used to end in an OverflowError inside a timer), and a path this locale cannot
carry (a non-ASCII name under ``LC_ALL=C PYTHONUTF8=0``) is refused at parse naming the encoding, instead of a
UnicodeEncodeError inside ``ray.init``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pd_dflash.cli import LIMITS, build_parser

REPO = Path(__file__).resolve().parents[2]

RUN = ["run", "s.yaml", "--out", "o"]
FLAGS = {
    "--connect-timeout": RUN,
    "--cell-timeout": RUN,
    "--max-attempts": RUN,
    "--h2d-gbps": ["overlap"],
}


def test_every_number_flag_has_named_limits():
    numbers = {
        a.option_strings[0]
        for p in build_parser()._subparsers._group_actions[0].choices.values()
        for a in p._actions
        if a.type is not None and getattr(a.type, "__name__", "") in ("float", "int")
    }
    assert numbers == set(LIMITS) == set(FLAGS)


@pytest.mark.parametrize("flag", sorted(FLAGS))
@pytest.mark.parametrize(
    "value", ["1e308", "1e400", "inf", "-inf", "nan", "-1", "0", "10**9", "", "9" * 5000]
)
def test_a_number_out_of_bounds_is_refused_at_parse_naming_the_flag_and_its_bounds(flag, value, capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args([*FLAGS[flag], flag, value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and "Traceback" not in err
    low, high = LIMITS[flag]
    assert f"between {low:g} and {high:g}" in err or "expected" in err, err


@pytest.mark.parametrize("flag", sorted(FLAGS))
def test_the_bounds_themselves_are_accepted(flag):
    low, high = LIMITS[flag]
    for value in (low, high):
        text = str(int(value)) if flag == "--max-attempts" else repr(float(value))
        args = build_parser().parse_args([*FLAGS[flag], flag, text])
        assert getattr(args, flag[2:].replace("-", "_")) == value


def cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pd_dflash", *args],
        cwd=REPO,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_connect_timeout_1e308_exits_2_with_the_limit_and_no_traceback(tmp_path):
    proc = cli("run", str(tmp_path / "s.yaml"), "--out", str(tmp_path / "o"), "--connect-timeout", "1e308")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "--connect-timeout: must be between 0.1 and 3600, got 1e308" in proc.stderr


def test_a_non_ascii_out_under_the_c_locale_is_refused_naming_the_encoding(tmp_path):
    spec = tmp_path / "s.yaml"
    spec.write_text("name: x\n")
    out = tmp_path / "résultats"
    proc = cli("run", str(spec), "--out", str(out), LC_ALL="C", LANG="C", PYTHONUTF8="0")
    said = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "Traceback" not in said and "UnicodeEncodeError" not in said, said
    assert "--out" in proc.stderr and "encoding (ascii)" in proc.stderr and "UTF-8" in proc.stderr
    assert not out.exists()
    # the spec path and the report's inputs are checked the same way
    proc = cli(
        "report", str(tmp_path / "lignes-é.jsonl"), "--out", str(tmp_path / "o"), LC_ALL="C", PYTHONUTF8="0"
    )
    assert proc.returncode == 2 and "encoding (ascii)" in proc.stderr and "Traceback" not in proc.stderr


def test_a_non_ascii_path_under_a_utf8_locale_is_taken(tmp_path):
    args = build_parser().parse_args(["run", "s.yaml", "--out", str(tmp_path / "résultats")])
    assert args.out.endswith("résultats")


def test_a_relative_out_under_a_non_ascii_working_directory_is_refused_before_ray_starts(tmp_path):
    import yaml

    from tests.sweep.helpers import spec_data

    spec = tmp_path / "s.yaml"
    spec.write_text(yaml.safe_dump(spec_data()))
    here = tmp_path / "dossier-é"
    here.mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "pd_dflash", "run", str(spec), "--out", "out"],
        cwd=here,
        env={**os.environ, "LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "--out" in proc.stderr and "encoding (ascii)" in proc.stderr
    assert not (here / "out").exists()
