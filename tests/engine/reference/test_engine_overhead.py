"""``benchmarks/engine_overhead.py --quick`` runs end to end on the CPU and writes a report of the documented
shape (its figures are recorded in docs/engine-overhead.md, never asserted here: a test checks that every path
was measured and counted, not how fast it was)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "benchmarks" / "engine_overhead.py"
TRANSFORMERS_PATHS = (
    "transformers eager generate",
    "transformers eager forward of 4 tokens",
    "transformers grouped_mm generate",
    "transformers grouped_mm forward of 4 tokens",
)
ENGINE_CELLS = {("B0", 1), ("B1", 1), ("B3", 1), ("OURS", 1), ("B0", 2), ("B3", 2)}


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("overhead") / "report.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=420,  # both geometries, BM2 and BM3 included
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text()), proc.stdout, out


def test_report_header(quick):
    doc, _, _ = quick
    assert doc["benchmark"] == "engine_overhead" and doc["schema_version"] == 2
    assert doc["status"] == "complete" and doc["device"] == "cpu"
    assert doc["settings"]["quick"] is True and doc["settings"]["concurrency"] == [1, 2]
    assert set(doc["geometries"]) == {"qwen3-coder-30b-a3b", "gpt-oss-20b"}


@pytest.mark.parametrize(
    "name, experts, top_k, storage",
    [("qwen3-coder-30b-a3b", 128, 8, "bf16"), ("gpt-oss-20b", 32, 4, "mxfp4")],
)
def test_every_path_is_measured_and_counted(quick, name, experts, top_k, storage):
    g = quick[0]["geometries"][name]
    assert (g["experts"], g["top_k"], g["storage"], g["layers"], g["status"]) == (
        experts,
        top_k,
        storage,
        2,
        "complete",
    )
    assert g["extrapolation_factor"] == g["real_layers"] / 2
    rows = {(r["path"], r["concurrency"]): r for r in g["rows"]}
    assert {p for p, _ in rows if p.startswith("transformers")} == set(TRANSFORMERS_PATHS)
    assert {k for k in rows if not k[0].startswith("transformers")} == ENGINE_CELLS
    for path in TRANSFORMERS_PATHS:
        unit = "forward" if "forward" in path else "token"
        r = rows[(path, 1)]
        assert r[f"ops_per_{unit}"] > 0 and r[f"ms_per_{unit}"] > 0 and r[f"host_syncs_per_{unit}"] >= 0
    assert rows[("transformers grouped_mm generate", 1)]["grouped_mm_ops"] > 0
    assert rows[("transformers eager generate", 1)]["grouped_mm_ops"] == 0
    for key in ENGINE_CELLS:
        r = rows[key]
        assert r["status"] == "OK", r
        assert r["ops_per_token"] > 0 and r["ms_per_token"] > 0 and r["host_syncs_per_token"] >= 0
        assert r["ops_per_verify_forward"] > 0 and r["ms_per_round"] > 0 and "warnings" not in r
        assert r["generated_tokens"] == 4 * key[1]
        assert ("dequantise_calls_timed" in r) == (storage == "mxfp4")
    # One output per cell: lossless configurations and a counting run that changes nothing.
    assert len({rows[k]["output_digest"] for k in ENGINE_CELLS if k[1] == 1}) == 1


@pytest.mark.parametrize("name", ["qwen3-coder-30b-a3b", "gpt-oss-20b"])
def test_ratios_and_bm2(quick, name):
    g = quick[0]["geometries"][name]
    ratios = g["ratios"]
    for key in (
        "b0_ops_per_token_over_grouped_mm_generate",
        "b3_ops_per_verify_forward_over_grouped_mm_forward",
        "b0_ms_per_token_over_eager_generate",
        "b3_ms_per_round_over_eager_forward",
    ):
        assert ratios[key] > 0
    assert set(ratios["b0_ops_per_token_by_concurrency"]) == {"1", "2"}
    bm2 = g["bm2"]
    assert bm2["benchmark"] == "BM2" and bm2["experts_issued"] == 2 * g["experts"] and bm2["iterations"] == 3
    assert bm2["issue_p50_us"] <= bm2["issue_p90_us"] <= bm2["issue_p99_us"] and bm2["window_us"] > 0
    assert bm2["candidate_required"] == (bm2["issue_p50_us"] > bm2["window_us"])
    modes = bm2["modes"]
    assert set(modes) == {"python-per-expert", "batched"} and all(m["dropped"] == 0 for m in modes.values())
    for m in modes.values():
        assert 0 < m["issue_p50_us"] <= m["issue_p90_us"] <= m["issue_p99_us"]
    batched = modes["batched"]["issue_p50_us"]
    assert bm2["batched_p50_over_per_expert_p50"] == pytest.approx(batched / bm2["issue_p50_us"])
    assert bm2["ship_batched"] == (bm2["candidate_required"] and batched <= bm2["window_us"])


@pytest.mark.parametrize("name", ["qwen3-coder-30b-a3b", "gpt-oss-20b"])
def test_bm3_runs_its_three_arms_on_identical_requests(quick, name):
    bm3 = quick[0]["geometries"][name]["bm3"]
    assert bm3["benchmark"] == "BM3" and bm3["status"] == "OK" and bm3["repeats"] == 2
    arms = bm3["arms"]
    assert {a: arms[a]["route_ahead_band"] for a in arms} == {
        "on-demand": 0,
        "route-ahead": 1,
        "background": 2,
    }
    for a in arms.values():
        assert (
            len(a["runs"]) == 2
            and a["exposed_fetch_seconds_median"] >= 0
            and a["tokens_per_second_median"] > 0
        )
    assert bm3["outputs_identical"]  # the band moves bytes, never tokens
    ex = {a: arms[a]["exposed_fetch_seconds_median"] for a in arms}
    ship = ex["route-ahead"] < ex["background"] and ex["on-demand"] <= min(
        ex["route-ahead"], ex["background"]
    )
    ship = (
        ship
        and arms["route-ahead"]["tokens_per_second_median"] >= arms["background"]["tokens_per_second_median"]
    )
    assert bm3["ship_priority_band"] == ship


def test_render_prints_the_tables(quick):
    _, stdout, path = quick
    rendered = subprocess.run(
        [sys.executable, str(SCRIPT), "--render", str(path)], capture_output=True, text=True, cwd=REPO
    )
    assert rendered.returncode == 0
    assert (
        "### gpt-oss-20b" in rendered.stdout
        and "| B3 | 1 |" in rendered.stdout
        and "BM2" in rendered.stdout
        and "BM3" in rendered.stdout
    )
    assert rendered.stdout.strip() in stdout


def test_bad_input_exits_2_naming_the_option():
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--cache-fraction", "1.5"], capture_output=True, text=True, cwd=REPO
    )
    assert proc.returncode == 2 and "--cache-fraction" in proc.stderr
