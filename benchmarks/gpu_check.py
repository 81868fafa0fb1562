"""The prepared GPU check (``scripts/gpu_check.sh`` runs it; ≤ 14 minutes on a CUDA box). Writes one JSON summary.

Steps, each bounded in time and recorded even when it fails:

1. ``environment``: Python, torch/CUDA, visible devices, whether a real MoE-Infinity is installed and what its
   build can express (``pd_dflash.engine.moe_infinity.features``).
2. ``probe``: ``pd-dflash probe`` (NVML identity, pinned 256 MiB × 20 host→device copies).
3. ``reference``: the reference engine on a mini preset through its public interface
   (``ReferenceEngine(ctx).run_cell(cell)``): B0 (offloaded) and B3 (resident) at c = 1 and 4 must generate
   identical greedy tokens, and the offloaded cells' measured transfer rate is compared with the probe.
4. ``real_tiny``, ``real_slice``, ``real_target`` (``benchmarks/gpu_real.py``): the tiny real-layout targets
   on the device (offloaded == resident tokens, MXFP4 dequantised on the device), a real-shaped one-layer slice
   of each Phase-A target (expert transfer rate ÷ the pinned probe, target ≥ 0.9), and one B0 cell of a real
   target when its weights are under HF_HOME (skipped with a message otherwise).
5. ``gpu_tests``: ``pytest -m gpu`` (junit counts), with the figures the GPU tests measured (link bandwidth
   against the probe, demand slowdown under a prefetch backlog, submit host time, exposed fetch, per-configuration
   transfers; ``tests/engine/reference/test_gpu_link.py`` and ``test_gpu.py``). The transfer-rate check of step 3
   is an upper bound only (mini presets' experts are 24–49 KiB, so per-copy latency dominates their rate); the
   lower bound, demand copies ≥ 0.7 × the probe, is checked on 64 MiB experts by the GPU tests.

On a machine without CUDA the CUDA-only parts say "skipped" and the reference step runs on the CPU, which checks
the script's plumbing. Usage: ``python benchmarks/gpu_check.py --output summary.json [--device auto|cuda|cpu]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
#: Transfers cannot beat the link: a measured transfer rate above probe × this is a measurement error.
MAX_TRANSFER_OVER_PROBE = 1.25


def _run_json(args: list[str], timeout: float) -> dict[str, Any]:
    """Run a sub-step in a fresh interpreter (bounded, isolated from CUDA state); its last stdout line is JSON."""
    start = time.perf_counter()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
    }
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"timed out after {timeout:g} s", "seconds": timeout}
    seconds = time.perf_counter() - start
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    try:
        result = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        return {"ok": False, "error": f"exit {proc.returncode}: {proc.stderr[-2000:]}", "seconds": seconds}
    result.setdefault("seconds", seconds)
    if proc.returncode != 0 and result.get("ok", True):
        result.update(ok=False, error=f"exit {proc.returncode}: {proc.stderr[-2000:]}")
    return result


def step_environment() -> dict[str, Any]:
    info: dict[str, Any] = {"ok": True, "python": sys.version.split()[0], "platform": platform.platform()}
    missing = []
    for module in ("torch", "transformers", "pydantic", "yaml", "pandas", "pytest", "nvtx", "pynvml"):
        try:
            __import__(module)
        except ImportError:
            missing.append(module)
    info["missing_modules"] = missing
    if missing:
        info.update(ok=False, error=f"missing modules: {', '.join(missing)} (install .[engine,dev])")
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda_available"] = torch.cuda.is_available()
        info["cuda_build"] = torch.version.cuda
        if torch.cuda.is_available():
            info["devices"] = [
                {
                    "name": torch.cuda.get_device_name(i),
                    "capability": list(torch.cuda.get_device_capability(i)),
                }
                for i in range(torch.cuda.device_count())
            ]
    except ImportError:
        pass
    info["moe_infinity"] = _moe_infinity_build()
    return info


def _moe_infinity_build() -> dict[str, Any]:
    """What an installed (real) MoE-Infinity can express; the test fake is never on this path."""
    try:
        import moe_infinity
    except ImportError as exc:
        return {"installed": False, "note": str(exc)}
    except Exception as exc:  # a broken native build: say so, it is exactly what operators need to know
        return {"installed": True, "import_error": f"{type(exc).__name__}: {exc}"}
    from pd_dflash.engine.moe_infinity.features import detect

    return {"installed": True, **detect(moe_infinity).as_dict()}


def step_probe() -> dict[str, Any]:
    from pd_dflash.engine.probe import probe

    result = probe()
    if not result["cuda_available"]:
        return {"ok": True, "skipped": "no CUDA device", **result}
    return {"ok": result.get("h2d", {}).get("bytes_per_second", 0) > 0, **result}


def step_reference(device: str, preset: str) -> dict[str, Any]:
    """B0 vs B3 through ReferenceEngine's public interface; run in its own interpreter."""
    from pd_dflash.engine.interface import EngineContext
    from pd_dflash.engine.reference.engine import ReferenceEngine
    from pd_dflash.spec import expand

    spec = _reference_spec(device, preset)
    ctx = EngineContext.for_model(spec, device="cuda:0" if device == "cuda" else "cpu")
    start = time.perf_counter()
    engine = ReferenceEngine(ctx)
    load_seconds = time.perf_counter() - start
    cells = [_run_reference_cell(engine, cell) for cell in expand(spec)]
    probe = engine.describe().get("h2d_probe_bytes_per_second")
    checks = _reference_checks(cells, probe)
    ok = all(v is not False for k, v in checks.items() if k.startswith("offloaded_equals"))
    ok = ok and all(e["status"] in ("OK", "PARTIAL") for e in cells)
    if device == "cuda":
        ratios = checks["transfer_rate_over_probe"]
        ok = ok and bool(ratios) and all(0 < r <= MAX_TRANSFER_OVER_PROBE for r in ratios)
        ok = ok and all(v is True for k, v in checks.items() if k.startswith("offloaded_equals"))
    return {
        "ok": ok,
        "device": device,
        "preset": preset,
        "load_seconds": load_seconds,
        "probe_bytes_per_second": probe,
        "checks": checks,
        "cells": cells,
    }


def _reference_spec(device: str, preset: str):
    from pd_dflash.engine import nvml
    from pd_dflash.spec import parse_spec

    identity = nvml.device_identity(0) if device == "cuda" else None
    return parse_spec(
        {
            "name": "gpu-check",
            "engine": "reference",
            "models": [{"id": preset, "preset": preset}],
            "baselines": ["B0", "B3"],
            "block_sizes": [8],
            "concurrency": [1, 4],
            "repeats": 1,
            "workload": {"requests": 8, "warmup_rounds": 1, "max_new_tokens": 32, "prompt_tokens": 16},
            "memory": {"expert_cache_fraction": 0.25},
            "hardware": {
                "device": device,
                "accelerator_type": None,
                "gpu_name": identity["name"] if identity else None,
                "compute_capability": identity["compute_capability"] if identity else None,
            },
        }
    )


def _run_reference_cell(engine, cell) -> dict[str, Any]:
    """One cell's summary; a refusal is recorded as the sweep's runner records it (its status and reason)."""
    from pd_dflash.engine.interface import Refused
    from pd_dflash.schema import EngineResult

    try:
        result = engine.run_cell(cell)
    except Refused as refusal:
        result = EngineResult(status=refusal.status, reason=refusal.reason)
    entry: dict[str, Any] = {
        "baseline": cell.baseline,
        "concurrency": cell.concurrency,
        "status": result.status.value,
        "reason": result.reason,
        "output_tokens_per_second": result.output_tokens_per_second,
        "expert_cache_hit_rate": result.expert_cache_hit_rate,
        "warnings": result.warnings,
    }
    if result.cost_terms is not None:
        entry["cost_terms"] = result.cost_terms.model_dump(exclude_none=True)
    # The sha256 prefix of the timed requests' generated tokens (the engine's ``output_digest`` fact).
    entry["output_digest"] = result.engine.get("output_digest")
    return entry


def _reference_checks(cells: list[dict[str, Any]], probe: float | None) -> dict[str, Any]:
    """Offloaded (B0) and resident (B3) generate the same tokens at each c; B0's transfer rate over the probe."""
    digests = {(e["baseline"], e["concurrency"]): e["output_digest"] for e in cells}
    checks: dict[str, Any] = {}
    for c in (1, 4):
        b0, b3 = digests.get(("B0", c)), digests.get(("B3", c))
        checks[f"offloaded_equals_resident_c{c}"] = None if b0 is None or b3 is None else b0 == b3
    ratios = []
    for entry in cells:
        terms = entry.get("cost_terms", {})
        if entry["baseline"] == "B0" and terms.get("h2d_seconds") and probe:
            ratios.append(terms["h2d_bytes"] / terms["h2d_seconds"] / probe)
    checks["transfer_rate_over_probe"] = ratios or None
    return checks


def step_gpu_tests(timeout: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        figures = Path(tmp) / "figures.jsonl"
        args = [
            sys.executable,
            "-m",
            "pytest",
            "-m",
            "gpu",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={junit}",
        ]
        start = time.perf_counter()
        env = {**os.environ, "PD_DFLASH_GPU_FIGURES": str(figures)}
        try:
            proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)
        except subprocess.TimeoutExpired:
            return {"ok": False, "error": f"pytest -m gpu timed out after {timeout:g} s", **_figures(figures)}
        counts: dict[str, Any] = {"exit_code": proc.returncode, "seconds": time.perf_counter() - start}
        if junit.exists():
            suite = ET.parse(junit).getroot()
            suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
            counts.update({k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")})
        counts["tail"] = proc.stdout[-1500:]
        counts.update(_figures(figures))
        # 5: no test selected; otherwise pytest's own verdict.
        counts["ok"] = proc.returncode in (0, 5)
        return counts


def _figures(path: Path) -> dict[str, Any]:
    """What the GPU tests measured (``record_figure`` in tests/engine/reference/conftest.py), if any."""
    if not path.exists():
        return {}
    return {"figures": [json.loads(line) for line in path.read_text().splitlines() if line.strip()]}


#: The steps in running order, each with its own time limit in seconds (cut to the overall budget).
STEPS: dict[str, float] = {
    "probe": 60,
    "reference": 240,
    "gpu_tests": 270,
    "real_tiny": 120,
    "real_slice": 150,
    "real_target": 240,
}


def _wanted_steps(text: str, *, skip_tests: bool) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in names if s not in STEPS]
    if unknown:
        raise SystemExit(f"gpu_check: unknown step(s) {', '.join(unknown)}; use {', '.join(STEPS)}")
    return [s for s in STEPS if s in names and not (skip_tests and s == "gpu_tests")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--output", help="summary JSON path (default: $OUT/gpu_check.json or ./gpu_check.json)"
    )
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument(
        "--preset", default=None, help="reference preset (default: mini-gpt-oss on CUDA, micro on CPU)"
    )
    parser.add_argument("--skip-tests", action="store_true", help="do not run pytest -m gpu")
    parser.add_argument(
        "--steps",
        default=",".join(STEPS),
        help=f"comma-separated steps to run, in this order: {','.join(STEPS)} (default: all)",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=540.0,
        help="overall seconds: each step's timeout is cut to what is left, steps past it are recorded as not run "
        "(default 540: one device call of at most 10 minutes, with room to write the summary)",
    )
    parser.add_argument("--step", choices=("reference",), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.step == "reference":  # the isolated sub-step
        print(json.dumps(step_reference(args.device, args.preset)))
        return 0

    started = time.perf_counter()
    summary: dict[str, Any] = {"started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "steps": {}}
    summary["steps"]["environment"] = env = step_environment()
    cuda = bool(env.get("cuda_available"))
    device = ("cuda" if cuda else "cpu") if args.device == "auto" else args.device
    preset = args.preset or ("mini-gpt-oss" if device == "cuda" else "micro")
    wanted = _wanted_steps(args.steps, skip_tests=args.skip_tests)
    deadline = started + args.budget_s
    real = str(REPO / "benchmarks" / "gpu_real.py")
    commands = {
        "reference": [
            sys.executable,
            str(Path(__file__).resolve()),
            "--step",
            "reference",
            "--device",
            device,
            "--preset",
            preset,
        ],
        "real_tiny": [sys.executable, real, "--step", "tiny", "--device", device],
        "real_slice": [sys.executable, real, "--step", "slice", "--device", device],
        "real_target": [sys.executable, real, "--step", "real", "--device", device],
    }
    for name in wanted:
        left = deadline - time.perf_counter()
        if left < 20:
            summary["steps"][name] = {
                "ok": False,
                "error": f"not run: the {args.budget_s:g} s budget was spent",
            }
            continue
        timeout = min(STEPS[name], left)
        if name == "probe":
            try:
                summary["steps"]["probe"] = step_probe()
            except Exception as exc:
                summary["steps"]["probe"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        elif name == "gpu_tests":
            summary["steps"]["gpu_tests"] = step_gpu_tests(timeout=timeout)
        else:
            summary["steps"][name] = _run_json(commands[name], timeout)
    summary["device"] = device
    summary["seconds"] = time.perf_counter() - started
    summary["ok"] = all(step.get("ok", False) for step in summary["steps"].values())
    out = Path(args.output or Path(os.environ.get("OUT", ".")) / "gpu_check.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2, sort_keys=True, default=str) + "\n")
    print(f"gpu check: {'ok' if summary['ok'] else 'FAILED'} in {summary['seconds']:.0f} s -> {out}")
    if device != "cuda":
        summary["note"] = "no CUDA device: the probe and GPU tests were skipped, the reference ran on the CPU"
        print(f"  note: {summary['note']}")
    for name, step in summary["steps"].items():
        note = step.get("error") or (step["skipped"] if isinstance(step.get("skipped"), str) else "")
        print(f"  {name}: {'ok' if step.get('ok') else 'FAILED'} {note}".rstrip())
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
