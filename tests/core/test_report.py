"""`pd-dflash report` / `validate`: upstream-format rows, the Phase-A grid, bad inputs, import hygiene.

Every row here is synthetic test data built in the test (upstream's published gpt-oss OURS figures,
or `expand(jobs/phase_a.yaml)` cells with made-up numbers); nothing is a measurement.
"""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pd_dflash.cli import main
from pd_dflash.errors import InputError
from pd_dflash.report import build_report, effective_gates, write_outputs
from pd_dflash.rows import append_row
from pd_dflash.schema import Row
from pd_dflash.spec import Gates
from pd_dflash.upstream import REQUIRED_METRICS, UPSTREAM_CSV_COLUMNS
from tests.core.helpers import CANONICAL_OURS, synth_rows, upstream, upstream_group

REPO = Path(__file__).resolve().parents[2]
PHASE_A = REPO / "jobs" / "phase_a.yaml"
GPTOSS = "openai/gpt-oss-20b"


def run_cli(*argv: str) -> int:
    return main([str(a) for a in argv])


# -- synthetic Phase-A grid -----------------------------------------------------------------------------


def write_jsonl(path: Path, rows) -> Path:
    for r in rows:
        append_row(path, r if isinstance(r, Row) else Row.model_validate(r))
    return path


def read_csv(path: Path) -> list[dict]:
    return list(csv.DictReader(io.StringIO(path.read_text())))


# -- upstream-format rows -------------------------------------------------------------------------------


def test_upstream_rows_give_upstream_keys_header_and_exit_codes(tmp_path, capsys):
    raw = tmp_path / "gpt-oss.json"
    raw.write_text(json.dumps(upstream_group(16, 1) + upstream_group(16, 8), indent=2))
    out = tmp_path / "out"
    # B2 is blocked (Phase A): incomplete unless allowed, as upstream's --allow-blocked.
    assert run_cli("report", raw, "--out", out) == 1
    printed = capsys.readouterr().out
    verdict = json.loads(printed[: printed.rindex("}") + 1])
    assert sorted(verdict) == [f"{GPTOSS}|B16|c1", f"{GPTOSS}|B16|c8"]
    group = verdict[f"{GPTOSS}|B16|c1"]
    assert group["present"] == ["B0", "B1", "B2", "B3"] and group["blocked"] == ["B2"]
    assert group["missing"] == [] and group["invalid"] == [] and group["complete"] is False
    assert printed.strip().splitlines()[-1].startswith("go/no-go: ")

    assert run_cli("report", raw, "--out", out, "--allow-blocked", "B2") == 0
    matrix = json.loads((out / "result_matrix.json").read_text())
    assert sorted(matrix) == [f"{GPTOSS}|B16|c1", f"{GPTOSS}|B16|c8"]
    b1 = matrix[f"{GPTOSS}|B16|c1"]["B1"]
    # upstream writes no status on an OK row (issue 12: its evaluate_matrix counts any status as blocked)
    assert b1["output_tokens_per_second"] == 40.0 and "status" not in b1 and b1["n_repeats"] == 1
    assert matrix[f"{GPTOSS}|B16|c1"]["B2"]["status"] == "BLOCKED_UNTIL_2D_SCHEDULER"
    assert "output_tokens_per_second" not in matrix[f"{GPTOSS}|B16|c1"]["B2"]
    text = (out / "result_matrix.json").read_text()
    # upstream's layout (indent 2, sorted keys); each stored repeat is one compact line, as the input holds it
    compact = {k: {b: {**r, "repeats": []} for b, r in g.items()} for k, g in matrix.items()}
    skeleton = "\n".join(line for line in text.split("\n") if not line.lstrip().startswith('{"model"'))
    assert skeleton.replace("[\n      ]", "[]") == json.dumps(compact, indent=2, sort_keys=True) + "\n"
    for r in matrix[f"{GPTOSS}|B16|c1"]["B1"]["repeats"]:
        assert "\n        " + json.dumps(r, separators=(",", ":")) + "\n" in text

    lines = read_csv(out / "result_matrix.csv")
    header = (out / "result_matrix.csv").read_text().splitlines()[0].split(",")
    assert tuple(header[:15]) == UPSTREAM_CSV_COLUMNS
    assert header[:5] == ["model", "block_size", "concurrency", "baseline", "status"]
    assert tuple(header[5:15]) == REQUIRED_METRICS
    assert [(r["concurrency"], r["baseline"]) for r in lines] == [
        (c, b) for c in ("1", "8") for b in ("B0", "B1", "B2", "B3")
    ]
    b2 = next(r for r in lines if r["baseline"] == "B2")
    assert b2["status"] == "BLOCKED_UNTIL_2D_SCHEDULER" and b2["output_tokens_per_second"] == ""
    md = (out / "result_matrix.md").read_text()
    assert md.startswith("# PD-DFlash Phase-A result matrix\n") and "go/no-go: " in md


def test_canonical_ours_row_reads_and_keeps_its_numbers(tmp_path, capsys):
    raw = tmp_path / "gptoss-bm4.json"
    raw.write_text(json.dumps(CANONICAL_OURS))  # a single row object
    assert run_cli("report", raw, "--out", tmp_path / "o") == 1  # B0..B3 missing
    verdict = json.loads((tmp_path / "o" / "verdict.json").read_text())
    group = verdict["groups"][f"{GPTOSS}|B16|c1"]
    assert group["missing"] == ["B0", "B1", "B2", "B3"]
    row = json.loads((tmp_path / "o" / "result_matrix.json").read_text())[f"{GPTOSS}|B16|c1"]["OURS"]
    for m in REQUIRED_METRICS:
        assert row[m] == CANONICAL_OURS[m]
    assert row["cost_terms"]["measured_h2d_bytes_per_second"] == 57553826518.35307
    assert row["warnings"] == ["kv_occupancy_bytes fell back to 0.0"]
    # Upstream rows carry no route-ahead counters and no BM1/hide terms: those gates are not evaluated.
    gates = group["gates"]
    assert gates["bm1"]["status"] == "not evaluated" and gates["hide_inequality"]["status"] == "not evaluated"
    assert (
        gates["waste"]["status"] == "not evaluated" and gates["speedup_over_b0"]["status"] == "not evaluated"
    )
    assert verdict["overall"]["verdict"] == "INCONCLUSIVE"
    capsys.readouterr()


def test_allow_blocked_from_spec_and_cli_and_unknown_name(tmp_path):
    raw = tmp_path / "rows.json"
    raw.write_text(json.dumps(upstream_group()))
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        PHASE_A.read_text().replace("require_ordering: true", "require_ordering: true\n  allow_blocked: [B2]")
    )
    assert (
        run_cli("report", raw, "--out", tmp_path / "a", "--spec", spec) == 1
    )  # spec grid: 23 groups missing
    verdict = json.loads((tmp_path / "a" / "verdict.json").read_text())
    assert len(verdict["groups"]) == 24
    assert verdict["groups"][f"{GPTOSS}|B16|c1"]["blocked_allowed"] == ["B2"]
    assert verdict["groups"][f"{GPTOSS}|B8|c1"]["missing"] == ["B0", "B1", "B2", "B3", "OURS"]
    with pytest.raises(InputError, match=r"--allow-blocked.*'B9'"):
        effective_gates(None, allow_blocked=["B9"])
    assert run_cli("report", raw, "--out", tmp_path / "b", "--allow-blocked", "B9") == 2
    assert not (tmp_path / "b").exists()


def test_allow_unmeasured_cli_flag(tmp_path):
    rows = upstream_group()
    for r in rows:
        if r["baseline"] == "B1":
            del r["route_ahead_prefetch_coverage"]
            r.update(status="PARTIAL", warnings=["route_ahead_prefetch_coverage: no accessor"])
    raw = tmp_path / "rows.json"
    raw.write_text(json.dumps(rows))
    args = ("report", raw, "--allow-blocked", "B2")
    assert run_cli(*args, "--out", tmp_path / "a") == 1
    assert run_cli(*args, "--out", tmp_path / "b", "--allow-unmeasured", "route_ahead_prefetch_coverage") == 0
    assert run_cli(*args, "--out", tmp_path / "c", "--allow-unmeasured", "coverage") == 2
    assert not (tmp_path / "c").exists()


def test_unavailable_capacity_b3_is_blocked_unless_allowed(tmp_path, capsys):
    rows = upstream_group()
    rows[2] = upstream("B2", tps=35.0)
    keep = ("model", "draft", "baseline", "block_size", "concurrency", "repeat")
    rows[3] = {**{k: v for k, v in rows[3].items() if k in keep}, "status": "UNAVAILABLE_CAPACITY"}
    raw = tmp_path / "r.json"
    raw.write_text(json.dumps(rows))
    assert run_cli("report", raw, "--out", tmp_path / "o") == 1
    assert run_cli("report", raw, "--out", tmp_path / "o", "--allow-blocked", "B3") == 0
    # validate: B3 UNAVAILABLE_CAPACITY is upstream's only exemption.
    assert run_cli("validate", tmp_path / "o" / "result_matrix.json") == 0
    capsys.readouterr()


# -- the Phase-A grid -----------------------------------------------------------------------------------


def test_upstream_equivalent_grid_is_96_rows_in_24_groups(tmp_path, capsys):
    rows = synth_rows(baselines={"B0", "B1", "B2", "B3"}, repeats={0})
    assert len(rows) == 2 * 6 * (1 + 2 + 2 + 2)  # B0 stored once per (model, c), B3 per block size: 84 rows
    rows_file = write_jsonl(tmp_path / "rows.jsonl", rows)
    assert run_cli("report", rows_file, "--out", tmp_path / "o") == 0
    lines = read_csv(tmp_path / "o" / "result_matrix.csv")
    assert len(lines) == 96 == 2 * 4 * 2 * 6
    matrix = json.loads((tmp_path / "o" / "result_matrix.json").read_text())
    assert len(matrix) == 24 and all(sorted(g) == ["B0", "B1", "B2", "B3"] for g in matrix.values())
    # B0 measured once at B=8, shown in both block-size groups with the same numbers, and said so.
    for c in (1, 32):
        b0_8, b0_16 = (matrix[f"{GPTOSS}|B{b}|c{c}"]["B0"] for b in (8, 16))
        assert b0_8["output_tokens_per_second"] == b0_16["output_tokens_per_second"]
        assert b0_16["shared_across_block_sizes"] == [8, 16] and b0_16["measured_at_block_size"] == 8
        assert "shared_across_block_sizes" not in matrix[f"{GPTOSS}|B16|c{c}"]["B1"]
    verdict = json.loads((tmp_path / "o" / "verdict.json").read_text())
    assert verdict["groups"][f"{GPTOSS}|B16|c4"]["shared_across_block_sizes"] == {"B0": [8, 16]}
    md = (tmp_path / "o" / "result_matrix.md").read_text()
    assert (
        "B0 is measured once per (c, repeat) and shown in every block-size group it covers: B = 8, 16" in md
    )
    assert run_cli("validate", tmp_path / "o" / "result_matrix.json") == 0
    capsys.readouterr()


def test_full_grid_with_three_repeats_gives_cis_and_gate_verdicts(tmp_path, capsys):
    rows = synth_rows()
    assert len(rows) == 324
    rows_file = write_jsonl(tmp_path / "rows.jsonl", rows)
    assert run_cli("report", rows_file, "--out", tmp_path / "o", "--spec", PHASE_A) == 0
    out = capsys.readouterr().out
    assert out.strip().splitlines()[-1].startswith("go/no-go: GO on means (")
    matrix = json.loads((tmp_path / "o" / "result_matrix.json").read_text())
    ours = matrix[f"{GPTOSS}|B16|c8"]["OURS"]
    agg = ours["aggregate"]["output_tokens_per_second"]
    assert agg["n"] == 3 and agg["ci95_low"] < agg["mean"] < agg["ci95_high"]
    values = [r["output_tokens_per_second"] for r in ours["repeats"]]
    assert agg["mean"] == pytest.approx(sum(values) / 3)
    assert [r["repeat"] for r in ours["repeats"]] == [0, 1, 2] and ours["repeats_aggregated"] == [0, 1, 2]
    lines = read_csv(tmp_path / "o" / "result_matrix.csv")
    assert len(lines) == 120  # 24 groups x 5 configurations
    assert all(line["output_tokens_per_second_ci95_low"] for line in lines)
    verdict = json.loads((tmp_path / "o" / "verdict.json").read_text())
    for g in verdict["groups"].values():
        assert {k: v["status"] for k, v in g["gates"].items()} == dict.fromkeys(g["gates"], "pass")


# -- bad inputs: exit 2, the message names the field / file:line, nothing written ---------------------------


def _line(**over) -> str:
    return json.dumps(upstream("OURS", **over))


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (_line(ttft_seconds=float("nan")), "rows.jsonl:2: ttft_seconds: ttft_seconds must be finite"),
        (_line(kv_occupancy_bytes=-1.0), "rows.jsonl:2: kv_occupancy_bytes"),
        (_line(output_tokens_per_second=True), "rows.jsonl:2: output_tokens_per_second"),
        (
            json.dumps({k: v for k, v in upstream("OURS").items() if k != "ttft_seconds"}),
            "rows.jsonl:2: <root>: status OK but metrics missing: ttft_seconds",
        ),
        ('{"model": "openai/gpt-oss-20b", "baseline": "OU', "rows.jsonl:2: invalid JSON"),
        (_line(status="MAYBE"), "rows.jsonl:2: status"),
        (
            _line(repeat=0),
            "duplicate identity (model=openai/gpt-oss-20b, baseline=OURS, block_size=16, concurrency=1, repeat=0): ",
        ),
    ],
    ids=["nan", "negative", "bool", "missing-metric", "torn-line", "unknown-status", "duplicate"],
)
def test_bad_rows_exit_2_name_the_place_and_write_nothing(tmp_path, capsys, content, needle):
    path = tmp_path / "rows.jsonl"
    path.write_text(_line() + "\n" + content + "\n")
    out = tmp_path / "out"
    assert run_cli("report", path, "--out", out) == 2
    err = capsys.readouterr().err
    assert needle in err, err
    assert f"{path}:2" in err  # the file and line (the duplicate names line 1 too)
    assert not out.exists()


def test_duplicate_names_both_sources_and_existing_outputs_survive(tmp_path, capsys):
    a = tmp_path / "a.json"
    a.write_text(json.dumps(upstream_group()))
    b = tmp_path / "b.jsonl"
    b.write_text("\n" + json.dumps(upstream("B1")) + "\n")
    out = tmp_path / "out"
    assert run_cli("report", a, "--out", out, "--allow-blocked", "B2") == 0
    before = (out / "result_matrix.json").read_bytes()
    assert run_cli("report", a, b, "--out", out) == 2
    err = capsys.readouterr().err
    assert f"{a}[1] and {b}:2" in err
    assert (out / "result_matrix.json").read_bytes() == before


def test_shared_b0_colliding_with_an_own_block_row_is_a_duplicate(tmp_path):
    rows = synth_rows(baselines={"B0"}, repeats={0})[:1]  # B0 at B=8 covering [8, 16]
    own = Row.model_validate({**rows[0].to_json_dict(), "block_size": 16, "block_sizes_covered": [16]})
    with pytest.raises(InputError, match=r"block_size=16.*shared across \[8, 16\]"):
        build_report([*rows, own], Gates())


def test_failed_row_superseded_by_a_later_retry(tmp_path, capsys):
    rows = synth_rows(baselines={"B0", "B1", "B2", "B3"}, repeats={0})
    failed = Row.model_validate(
        {
            **{k: v for k, v in rows[0].to_json_dict().items() if k not in REQUIRED_METRICS},
            "status": "ERROR",
            "reason": "CUDA OOM",
        }
    )
    path = write_jsonl(tmp_path / "rows.jsonl", [failed, *rows])
    assert run_cli("report", path, "--out", tmp_path / "o") == 0
    md = (tmp_path / "o" / "result_matrix.md").read_text()
    assert f"superseded failed row {path}:1 by {path}:2" in md
    # The other way round (a measured row, then another) stays an error.
    path2 = write_jsonl(tmp_path / "rows2.jsonl", [rows[0], failed])
    assert run_cli("report", path2, "--out", tmp_path / "o2") == 2
    capsys.readouterr()


def test_unreadable_inputs_exit_2(tmp_path, capsys):
    assert run_cli("report", tmp_path / "nope.jsonl", "--out", tmp_path / "o") == 2
    assert "nope.jsonl: cannot read rows" in capsys.readouterr().err
    rows = tmp_path / "rows.json"
    rows.write_text(json.dumps(upstream_group()))
    (tmp_path / "taken").write_text("a file, not a directory")
    assert run_cli("report", rows, "--out", tmp_path / "taken") == 2
    assert "cannot write outputs" in capsys.readouterr().err
    bad = tmp_path / "m.json"
    bad.write_text("{not json")
    assert run_cli("validate", bad) == 2
    assert "m.json:1: invalid JSON" in capsys.readouterr().err
    bad.write_text("[1, 2]")
    assert run_cli("validate", bad) == 2
    assert not (tmp_path / "o").exists()


# -- validate -------------------------------------------------------------------------------------------


def test_validate_reports_upstreams_error_texts(tmp_path, capsys):
    good = {b: {m: 1.0 for m in REQUIRED_METRICS} for b in ("B0", "B1", "B2", "B3")}
    bad = json.loads(json.dumps(good))
    del bad["B2"]
    del bad["B1"]["ttft_seconds"]
    bad["B0"]["kv_occupancy_bytes"] = True
    bad["B3"]["ttft_seconds"] = -1
    path = tmp_path / "m.json"
    path.write_text(json.dumps({"m|B8|c1": good, "m|B8|c2": bad}))
    assert run_cli("validate", path) == 1
    out = capsys.readouterr().out
    result = json.loads(out[: out.rindex("}") + 1])
    assert result["m|B8|c1"] == {"valid": True, "errors": []}
    errors = result["m|B8|c2"]["errors"]
    assert "missing baselines: B2" in errors
    assert "B1 missing metric: ttft_seconds" in errors
    assert "B0.kv_occupancy_bytes must be a finite, non-negative number; got True" in errors
    assert "B3.ttft_seconds must be a finite, non-negative number; got -1" in errors
    assert "validate: 1/2 groups valid" in out
    path.write_text(json.dumps({"m|B8|c1": {**good, "B0": {**good["B0"], "ttft_seconds": float("nan")}}}))
    assert run_cli("validate", path) == 1
    assert "B0.ttft_seconds must be a finite, non-negative number; got nan" in capsys.readouterr().out


# -- the collector's entry point ------------------------------------------------------------------------


def test_write_outputs_tolerates_an_incomplete_matrix(tmp_path):
    rows = synth_rows(repeats={0})[:40]
    verdict = write_outputs(rows, tmp_path / "live", Gates())
    assert verdict["exit_code"] == 1 and verdict["complete"] is False
    assert verdict["overall"]["verdict"] in {"INCONCLUSIVE", "NO-GO"}
    assert {p.name for p in (tmp_path / "live").iterdir()} >= {
        "result_matrix.json",
        "result_matrix.csv",
        "result_matrix.md",
    }
    assert write_outputs([], tmp_path / "empty", Gates())["exit_code"] == 1


# -- layering: plan, report and validate import neither torch nor ray --------------------------------------


def test_plan_report_validate_import_neither_torch_nor_ray(tmp_path):
    raw = tmp_path / "r.json"
    raw.write_text(json.dumps(upstream_group()))
    out = tmp_path / "o"
    code = f"""
import sys, contextlib, io
from pd_dflash.cli import main
with contextlib.redirect_stdout(io.StringIO()):
    assert main(["plan", {str(PHASE_A)!r}, "--json"]) == 0
    assert main(["report", {str(raw)!r}, "--out", {str(out)!r}, "--allow-blocked", "B2", "--plots"]) == 0
    assert main(["validate", {str(out / "result_matrix.json")!r}]) == 1
bad = [m for m in ("torch", "ray") if m in sys.modules]
assert not bad, bad
print("clean")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "clean"
    # --plots wrote the three PNGs of the one model (matplotlib is allowed; torch and ray are not).
    pngs = sorted(p.name for p in (out / "plots").glob("*.png"))
    assert pngs == [
        f"openai_gpt-oss-20b_{what}.png"
        for what in ("acceptance_length", "coverage_waste", "tokens_per_second")
    ]
    assert all(
        (out / "plots" / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        and (out / "plots" / p).stat().st_size > 1000
        for p in pngs
    )
    # And through the module entry point, as a user runs it.
    done = subprocess.run(
        [sys.executable, "-m", "pd_dflash", "validate", str(out / "result_matrix.json")],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert done.returncode == 1 and "B2 missing metric: output_tokens_per_second" in done.stdout
