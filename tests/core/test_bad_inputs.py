"""Every bad input is named, exits 2, writes nothing, and quotes at most a bounded excerpt of itself (issue 12,
item 5); no code runs at plan time (item 4); a sweep has a bounded number of cells (item 6)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pd_dflash.cli import main
from pd_dflash.errors import MAX_MESSAGE
from pd_dflash.plan import plan, write_plan_json
from pd_dflash.spec import DEFAULT_MAX_CELLS, parse_spec
from tests.core.helpers import spec_data, upstream, upstream_group

REPO = Path(__file__).resolve().parents[2]


def plan_exit(tmp_path: Path, capsys, text: str | bytes) -> tuple[int, str]:
    """Run `pd-dflash plan` on a spec file with this content; the exit code and stderr."""
    path = tmp_path / "spec.yaml"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    capsys.readouterr()
    code = main(["plan", str(path)])
    err = capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spec.yaml"]  # nothing written
    assert len(err) < MAX_MESSAGE + 600, len(err)  # a bounded excerpt, never the whole input
    return code, err


# -- specs ---------------------------------------------------------------------------------------------------

BOMB = "\n".join(
    ["a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    + [f"{b}: &{b} [{', '.join(['*' + a] * 9)}]" for a, b in zip("abcdefgh", "bcdefghi", strict=True)]
)


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe binary", "not UTF-8 text (byte 0x89 at offset 0)"),
        ("name: " + "[" * 5000 + "]" * 5000, "nested deeper than 64 levels"),
        ("repeats: " + "7" * 5000, "integer literal of 5000 characters is too long"),
        (yaml.safe_dump(spec_data()) + "repeats: 3\n", "duplicate key 'repeats'"),
        (BOMB, "expands to more than 100000 nodes"),
        ("a: &a [*a]\n", "an alias refers to a node that contains it"),
    ],
    ids=["binary", "deep", "huge-int-literal", "duplicate-key", "alias-bomb", "recursive-alias"],
)
def test_unreadable_specs_are_named(tmp_path, capsys, content, needle):
    # The alias bomb is refused by counting its expanded nodes, before anything is built from it (it took 41 s
    # to be refused before, because the error echoed the whole expanded input; plan_exit bounds the message).
    code, err = plan_exit(tmp_path, capsys, content)
    assert code == 2 and needle in err and str(tmp_path / "spec.yaml") in err, err


@pytest.mark.parametrize(
    ("over", "field"),
    [
        ({"repeats": True}, "repeats"),
        ({"repeats": 2.0}, "repeats"),
        ({"concurrency": ["4"]}, "concurrency.0"),
        ({"block_sizes": [8.0]}, "block_sizes.0"),
        ({"workload": {"requests": "64"}}, "workload.requests"),
        ({"gates": {"require_ordering": "yes"}}, "gates.require_ordering"),
        ({"models": [{"id": "micro", "preset": "nano"}]}, "models.0.preset"),
        ({"engine": "moe_infinity", "models": [{"id": "openai/gpt-oss-20b"}]}, "models.0.offload_dir"),
        ({"repeats": 10**400}, "max_cells"),
        ({"engine": "not a module"}, "engine"),
    ],
    ids=[
        "bool-int",
        "float-int",
        "str-int",
        "float-block",
        "str-requests",
        "str-bool",
        "unknown-preset",
        "moe-infinity-offload-dir",
        "400-digit-repeats",
        "engine-form",
    ],
)
def test_wrong_specs_are_refused_at_plan_time(tmp_path, capsys, over, field):
    code, err = plan_exit(tmp_path, capsys, yaml.safe_dump(spec_data(**over)))
    assert code == 2 and field in err, err


def test_strict_types_still_accept_what_a_person_writes(tmp_path, capsys):
    data = spec_data(
        slo={
            "ttft_ms": 100
        },  # an int for a float is fine (the memory ratios: MoE-Infinity's, test_plan_refusals)
        hardware={"compute_capability": [12, 0]},  # YAML has no tuples
        workload={"max_new_tokens": "auto", "temperature": 0},
    )
    path = tmp_path / "ok.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["plan", str(path)]) == 0


def test_a_billion_repeats_fail_at_once_before_anything_is_expanded(tmp_path, capsys):
    # The count is arithmetic on the axes (spec.cell_count): nothing is expanded to refuse it.
    code, err = plan_exit(tmp_path, capsys, yaml.safe_dump(spec_data(repeats=1_000_000_000)))
    assert code == 2 and "expands to 6,000,000,000 cells, more than max_cells = 100000" in err, err


def test_max_cells_is_configurable_and_not_part_of_the_measurement():
    with pytest.raises(Exception, match="max_cells"):
        parse_spec(spec_data(max_cells=11))  # 3 baselines x 2 c x 2 repeats = 12 cells
    small = parse_spec(spec_data(max_cells=12))
    assert DEFAULT_MAX_CELLS == 100_000
    assert small.fingerprint() == parse_spec(spec_data()).fingerprint()
    assert len(plan(small)["cells"]) == 12


def test_plan_json_is_streamed_with_the_same_bytes(tmp_path):
    import io

    spec = parse_spec(spec_data(block_sizes=[8, 16]))
    buf = io.StringIO()
    write_plan_json(spec, buf)
    assert buf.getvalue() == json.dumps(plan(spec)) + "\n"


# -- no code runs at plan time ------------------------------------------------------------------------------


def test_plan_does_not_import_a_custom_engine(tmp_path):
    (tmp_path / "evil_engine.py").write_text(
        "import pathlib\npathlib.Path(__file__).with_name('IMPORTED').write_text('ran at plan time')\n"
        "class Engine: pass\n"
    )
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        yaml.safe_dump(
            spec_data(engine="evil_engine:Engine", models=[{"id": "m", "engine_options": {"x": 1}}])
        )
    )
    env = {"PYTHONPATH": f"{tmp_path}:{REPO}", "PATH": "/usr/bin:/bin"}
    for argv in (["plan", str(spec)], ["plan", str(spec), "--json"]):
        done = subprocess.run(
            [sys.executable, "-m", "pd_dflash", *argv], capture_output=True, text=True, cwd=tmp_path, env=env
        )
        assert done.returncode == 0, done.stderr
        assert "unverified until preflight" in done.stdout
    assert not (tmp_path / "IMPORTED").exists()


# -- row files and matrices ------------------------------------------------------------------------------


def report_exit(tmp_path: Path, capsys, content: bytes | str, name: str = "rows.jsonl") -> tuple[int, str]:
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    capsys.readouterr()
    code = main(["report", str(path), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    assert len(err) < MAX_MESSAGE + 600, len(err)
    return code, err


def _deep(levels: int) -> str:
    return json.dumps(upstream("B0", engine={"x": "__DEEP__"})).replace(
        '"__DEEP__"', "[" * levels + "]" * levels
    )


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (b"\x00\x01\xff\xfe\x80 binary rows\n", "not UTF-8 text"),
        (_deep(100_000) + "\n", "nested deeper than 64 levels"),
        (_deep(200) + "\n", "nested deeper than 64 levels"),
        (
            json.dumps(upstream("B0")).replace(
                '"kv_occupancy_bytes": 0.0', '"kv_occupancy_bytes": ' + "9" * 400
            )
            + "\n",
            "kv_occupancy_bytes must be at most 2**63 - 1",
        ),
        (
            json.dumps(upstream("B0")).replace('"repeat": 0', '"repeat": ' + "9" * 5000) + "\n",
            "integer literal is too long",
        ),
        (json.dumps(upstream("B0", engine={"x": float("nan")})) + "\n", "NaN in a free-form field"),
        ("", "holds no rows"),
        ("\n  \n", "holds no rows"),
    ],
    ids=[
        "binary",
        "deep-100000",
        "deep-200",
        "400-digit-metric",
        "5000-digit-repeat",
        "nan-free-form",
        "empty",
        "blank",
    ],
)
def test_bad_row_files_are_named(tmp_path, capsys, content, needle):
    code, err = report_exit(tmp_path, capsys, content)
    assert code == 2 and needle in err and "rows.jsonl" in err, err


def test_an_empty_json_list_is_named_too(tmp_path, capsys):
    code, err = report_exit(tmp_path, capsys, "[]", name="rows.json")
    assert code == 2 and "holds no rows" in err


@pytest.mark.parametrize("command", ["report", "run"])
def test_an_empty_out_is_refused(tmp_path, command):
    rows = tmp_path / "rows.json"
    rows.write_text(json.dumps(upstream_group()))
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(spec_data()))
    source = rows if command == "report" else spec
    done = subprocess.run(
        [sys.executable, "-m", "pd_dflash", command, str(source), "--out", ""],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 2 and "--out" in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rows.json", "spec.yaml"]


def test_validate_checks_each_group_key_against_its_rows(tmp_path, capsys):
    out = tmp_path / "o"
    rows = tmp_path / "rows.json"
    rows.write_text(json.dumps(upstream_group()))
    assert main(["report", str(rows), "--out", str(out), "--allow-blocked", "B2"]) == 0
    matrix = json.loads((out / "result_matrix.json").read_text())
    ((key, group),) = matrix.items()
    lying = tmp_path / "lying.json"
    lying.write_text(json.dumps({key.replace("|c1", "|c8"): group, "no-key": group}))
    capsys.readouterr()
    assert main(["validate", str(lying)]) == 1
    result = json.loads(capsys.readouterr().out.rsplit("\nvalidate:", 1)[0])
    errors = result[key.replace("|c1", "|c8")]["errors"]
    assert "B0.concurrency is 1 but the group key says 8" in errors
    assert result["no-key"]["errors"][0].startswith(
        "group key 'no-key' is not model|B<block_size>|c<concurrency>"
    )
    empty = tmp_path / "empty.json"
    empty.write_text("{}")
    assert main(["validate", str(empty)]) == 2
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe{}")
    assert main(["validate", str(binary)]) == 2
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    assert main(["validate", str(deep)]) == 2
    assert "nested deeper" in capsys.readouterr().err
