"""The GPU check cannot rot: ``scripts/gpu_check.sh --cpu`` runs every step's CPU-runnable part with the code the
CUDA run uses, and its JSON summary has the shape docs/gpu-check.md describes. Also the engine's transformers
check and the step budgets against the device call's limit."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pd_dflash.engine.reference.requirements import transformers_problem
from tests.conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import gpu_check
import gpu_steps

#: One device call runs at most this long (docs/gpu-check.md; the device tool's notes).
DEVICE_CALL_S = 480


def test_the_step_budgets_and_the_hard_limit_fit_one_device_call():
    assert sum(gpu_check.STEPS.values()) + 30 <= DEVICE_CALL_S  # gpu_check.sh: timeout = budget + 30 s
    assert list(gpu_check.STEPS)[:2] == ["bundle", "preflight"] and "real_size" in gpu_check.STEPS
    shell = (REPO / "scripts" / "gpu_check.sh").read_text()
    assert (
        f"budget=$((cpu ? {3 * sum(gpu_check.STEPS.values()):g} : {sum(gpu_check.STEPS.values()):g}))"
        in shell
    )


@pytest.mark.parametrize(
    ("installed", "refused"),
    [
        ("5.17.0", True),
        ("5.23.9", True),
        ("4.57.1", True),
        ("5.24.0", False),
        ("5.25.0.dev0", False),
        ("6.0", False),
    ],
)
def test_transformers_older_than_5_24_is_refused_naming_both_versions(installed, refused):
    problem = transformers_problem(installed)
    assert (problem is not None) == refused
    if refused:
        assert installed in problem and ">= 5.24" in problem


@pytest.mark.parametrize(
    ("capability", "archs", "match"),
    [
        ((9, 0), ["sm_80", "sm_90", "sm_100", "sm_120"], "sm"),  # H200 on a cu130 build
        ((9, 0), ["sm_80", "sm_90a"], "sm"),
        ((12, 0), ["sm_80", "sm_90", "compute_90"], "ptx"),  # RTX PRO 6000 on a build without sm_120
        ((12, 0), ["sm_80", "sm_90"], None),
    ],
)
def test_the_device_arch_is_checked_against_torchs_arch_list(capability, archs, match):
    assert gpu_steps.arch_match(*capability, archs) == match


@pytest.fixture(scope="module")
def micro_with_drafter(micro):
    """The check's CPU configurations load micro and its DFlash drafter from the cache: trained here first (on a
    fresh cache that takes minutes, more than the step's budget), so the run measures the check, not training."""
    from pd_dflash.engine.reference.presets.catalog import get_preset
    from pd_dflash.engine.reference.presets.drafters import load_drafter

    load_drafter(get_preset("micro"), micro[0], block_size=8)  # the check's block size (gpu_steps.py)


#: The default suite's run: every step but ``real_size`` (minutes at real width: the ``heavy`` test below).
SUITE_STEPS = [name for name in gpu_check.STEPS if name != "real_size"]


def run_cpu_check(tmp_path, steps: list[str], timeout: float) -> dict:
    summary = tmp_path / "gpu_check.json"
    proc = subprocess.run(
        [str(REPO / "scripts" / "gpu_check.sh"), str(summary), "--cpu", "--steps", ",".join(steps)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )
    assert summary.exists(), proc.stderr
    data = json.loads(summary.read_text())
    assert proc.returncode == 0 and data["ok"], (proc.stdout, json.dumps(data, indent=1)[:4000])
    assert data["mode"] == "cpu" and list(data["steps"]) == steps
    for name, step in data["steps"].items():
        assert step["ok"] is True and 0 <= step["seconds"] <= step["budget_s"] + 5, name
    assert data["step_budgets_s"] == {k: 3 * gpu_check.STEPS[k] for k in steps}
    return data


@pytest.mark.slow
@pytest.mark.timeout(900)  # a fresh cache trains micro's drafter first
def test_the_cpu_run_passes_every_step_and_writes_the_summary_shape(tmp_path, micro_with_drafter):
    data = run_cpu_check(tmp_path, SUITE_STEPS, timeout=800)
    pre = data["steps"]["preflight"]
    assert pre["versions"]["transformers"] and pre["transformers_problem"] is None and pre["missing"] == []
    for name in ("link_tests", "configuration_tests"):  # every gpu file collected (none errors without Ray)
        junit = data["steps"][name]["junit"]
        assert junit["tests"] > 0 and junit["errors"] == junit["failures"] == 0, name
    configurations = data["steps"]["configurations"]
    assert {(c["baseline"], c["concurrency"]) for c in configurations["cells"]} == {
        (b, c) for b in ("B0", "B1", "B2", "B3", "OURS") for c in (1, 4)
    }
    ar = configurations["checks"]["ar_vs_speculative"]
    assert [d["concurrency"] for d in ar] == [1, 4] and all(d["ok"] for d in ar)
    assert any(p["compared"] for p in configurations["checks"]["same_shape_equal"])
    overhead = data["steps"][
        "overhead"
    ]  # issue 20's benchmark at its CI smoke size, once the checkout has it
    assert "not available" in overhead.get("skipped", "") or overhead["result"]["status"] == "complete"
    pinning = data["steps"]["pinning"]
    assert pinning["host_copy_bytes_per_second"] > 0 and "skipped" in pinning["registration"]


@pytest.mark.heavy
@pytest.mark.timeout(1500)  # real_size writes and loads ~3 GB of real-width experts per run
def test_the_cpu_real_size_step_measures_both_targets_at_real_width(tmp_path):
    data = run_cpu_check(tmp_path, ["bundle", "preflight", "real_size"], timeout=1400)
    check_real_size(data["steps"]["real_size"]["result"])


#: One expert of Qwen3-Coder-30B-A3B in bf16: gate, up and down, 2048 × 768 each, 2 bytes.
QWEN3_CODER_EXPERT_BYTES = 3 * 2048 * 768 * 2


def check_real_size(result: dict) -> None:
    """The real_size step's JSON: both targets at real width and 2 layers, every cell OK with the hide terms."""
    assert result["status"] == "complete" and result["ok"] is True
    assert "meaningless" in result["random_weights"]
    targets = result["targets"]
    assert set(targets) == {"qwen3-coder-30b-a3b", "gpt-oss-20b"}
    qwen = targets["qwen3-coder-30b-a3b"]
    assert qwen["expert_nbytes_published_layout"] == QWEN3_CODER_EXPERT_BYTES == 9_437_184
    assert qwen.get("engine", {}).get("expert_nbytes", QWEN3_CODER_EXPERT_BYTES) == QWEN3_CODER_EXPERT_BYTES
    for name, target in targets.items():
        assert target["layers"] == 2 and target["depth_factor"] == target["published_layers"] / 2, name
        cells = {(c["baseline"], c["concurrency"]): c for c in target["cells"]}
        assert set(cells) == {(b, c) for b in ("B0", "B3", "OURS") for c in (1, 4)}, name
        # The step's budget decides how many cells run on a loaded machine: a cell is OK or said not run.
        ran = {key: cell for key, cell in cells.items() if "not_run" not in cell}
        assert ran and all(c["not_run"] == "budget spent" for k, c in cells.items() if k not in ran), name
        for key, cell in ran.items():
            assert cell["status"] == "OK", (name, key, cell.get("reason"))
            terms = cell["hide_terms"]
            assert {"t_fetch_s", "t_draft_s", "t_router_s", "t_verify_s"} <= set(terms), (name, key)
            assert terms["t_verify_s"] > 0 and cell["ms_per_token"] > 0 and cell["expert_compute"]["path"]
            if key[0] != "B3":  # offloaded at 25 %: misses are fetched over the (emulated) link
                assert terms["t_fetch_s"] is not None and cell["h2d"]["bytes"] > 0, (name, key)
        if "stopped" not in target:  # the target ran to its end within its share
            gemm = target["grouped_gemm_vs_gathered_bmm"]
            assert gemm["grouped_mm_ms"] > 0 and gemm["gathered_bmm_ms"] > 0, name


@pytest.mark.parametrize(
    ("args", "why"),
    [
        (["--budget-s", "1e3"], "plain decimal number"),
        (["--budget-s"], "--budget-s needs a value"),
        (["--budget-s", "--cpu"], "--budget-s needs a value"),
        (["--budget-s", "5"], "from 10 to 7200"),
        (["--budget-s", "99999999999999999999"], "from 10 to 7200"),
        (["--steps"], "--steps needs a value"),
        (["--steps", "a,,b"], "comma-separated step names"),
        (["--output", "x.json"], "unknown argument '--output'"),
        (["--cpu", "extra.json"], "unknown argument 'extra.json'"),
    ],
)
def test_bad_arguments_exit_2_with_a_summary_saying_why(tmp_path, args, why):
    summary = tmp_path / "out" / "gpu_check.json"
    proc = subprocess.run(
        [str(REPO / "scripts" / "gpu_check.sh"), str(summary), *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    data = json.loads(summary.read_text())
    assert data["ok"] is False and why in data["error"] and why in proc.stderr
    assert data["steps"] == {}


def test_an_unknown_step_is_refused_by_name_in_the_summary(tmp_path):
    summary = tmp_path / "gpu_check.json"
    assert gpu_check.main(["--output", str(summary), "--steps", "preflight,bogus"]) == 2
    data = json.loads(summary.read_text())
    assert data["ok"] is False and "bogus" in data["error"] and "real_size" in data["error"]
    assert gpu_check.main(["--output", str(summary), "--budget-s", "nan"]) == 2
    assert "--budget-s" in json.loads(summary.read_text())["error"]
