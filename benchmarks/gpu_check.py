"""The prepared GPU check (``scripts/gpu_check.sh`` runs it): one device call of at most 480 s on a bare CUDA box
with no network, that answers whether the CUDA path works and how fast the engine is at real shapes.

Steps, in order, each time-boxed (``STEPS``: the budgets add up to 440 s, under the shell's 470 s hard limit),
each in its own interpreter except ``bundle``; the JSON summary is rewritten after EVERY step, so a kill at the
limit loses at most the step in flight:

1. ``bundle``: the wheels of ``scripts/gpu_bundle.sh`` (``.whl/``) installed with ``pip install --no-index
   --no-deps --target`` into a temporary directory put first on every later step's path (skipped when there
   is no ``.whl/``, or, with ``--cpu``, when it was built for another Python).
2. ``preflight``: versions, the engine's transformers check, on CUDA the device's arch in
   ``torch.cuda.get_arch_list()``, the pinned probe and a 1 GiB ``cudaHostRegister`` (``gpu_steps.py``).
3. ``link_tests``: the CUDA link's ordering, timing and device-tool tests (gpu test files named explicitly, so
   nothing imports Ray).
4. ``configurations``: B0, B1, B2, B3, OURS at c = 1 and 4 on a trained preset, equality only where it must hold,
   AR against speculative by logits within a tolerance (``gpu_steps.py``).
5. ``configuration_tests``: every configuration on CUDA at equal shapes, the tiny real-layout targets.
6. ``overhead``: ``benchmarks/engine_overhead.py --device D --layers N --json PATH`` at real shapes ("not
   available" when the checkout does not have it).
7. ``pinning``: registration time and H2D GB/s for 4, 16 and 32 GiB, whole and in per-layer chunks, against the
   probe (``gpu_steps.py``).
8. ``real_size``: both Phase-A targets at their published width (``gpu_size.py``): B0, B3, OURS at c = 1 and 4,
   B = 16, 25 % cache; the hide terms, H2D GB/s at the real expert size, busy fraction and ops of one cell,
   grouped GEMM against gathered bmm at the real dimensions.

Bad arguments (an unknown step, a budget out of range) write a summary saying why and exit 2.

``--cpu`` runs every step's CPU-runnable part with the same code (CI runs it: tests/engine/reference/
test_gpu_check.py). ``real_slice`` and ``real_target`` (``gpu_real.py``) are not in the default list; name them
in ``--steps`` for a second call. Usage: ``python benchmarks/gpu_check.py --output S.json [--cpu] [--steps a,b]``.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
#: The default steps and their time limits in seconds (440 in all: the shell's hard limit is 470 s, the device
#: call's 480 s).
STEPS: dict[str, float] = {
    "bundle": 20,
    "preflight": 30,
    "link_tests": 45,
    "configurations": 70,
    "configuration_tests": 60,
    "overhead": 40,
    "pinning": 30,
    "real_size": 145,
}
#: ``--cpu`` stretches every budget by this factor: a shared 2-core CI machine is slower than the box and has no
#: call limit (what it checks is that every step still runs, not how fast).
CPU_BUDGET_FACTOR = 3
#: Steps a second call may name (``--steps``): the real-shaped slice and a real target under HF_HOME.
EXTRA_STEPS: dict[str, float] = {"real_slice": 150, "real_target": 240}
LINK_TESTS = (
    "tests/engine/reference/test_gpu_link.py",
    "tests/engine/test_device_tools.py",
    "tests/engine/moe_infinity/test_device_path.py",
)
CONFIGURATION_TESTS = ("tests/engine/reference/test_gpu.py", "tests/engine/reference/test_gpu_real.py")
OVERHEAD = REPO / "benchmarks" / "engine_overhead.py"
#: The overhead benchmark's size: both real geometries with the layers cut to fit the time box on CUDA (its
#: report extrapolates to the real depth), c = 1 and 4, no profiler pass (``real_size`` profiles one cell per
#: target); its CI smoke size on the CPU.
OVERHEAD_ARGS = {
    "cuda": ["--device", "cuda", "--layers", "4", "--concurrency", "4", "--no-profile"],
    "cpu": ["--device", "cpu", "--quick"],
}
REAL_SIZE = REPO / "benchmarks" / "gpu_size.py"
#: ``--budget-s`` bounds (scripts/gpu_check.sh checks the same).
BUDGET_RANGE_S = (10.0, 7200.0)


class Check:
    """The run's state: the summary (rewritten after every step), the deadline, the bundle's site directory."""

    def __init__(self, output: Path, device: str, budget_s: float, cpu: bool) -> None:
        self.output, self.device, self.cpu = output, device, cpu
        self.started = time.perf_counter()
        self.deadline = self.started + budget_s
        self.site: str | None = None
        self.summary: dict[str, Any] = {
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "mode": "cpu" if cpu else "cuda",
            "device": device,
            "budget_s": budget_s,
            "pd_dflash_cache": os.environ.get("PD_DFLASH_CACHE"),
            "steps": {},
        }

    def env(self) -> dict[str, str]:
        paths = [p for p in (self.site, str(REPO), os.environ.get("PYTHONPATH")) if p]
        return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}

    def write(self) -> None:
        steps = self.summary["steps"].values()
        self.summary["seconds"] = time.perf_counter() - self.started
        self.summary["ok"] = bool(steps) and all(s.get("ok", False) for s in steps)
        self.output.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.output.with_name(self.output.name + ".tmp")
        tmp.write_text(json.dumps(self.summary, indent=2, default=str) + "\n")
        os.replace(tmp, self.output)

    def run_step(self, name: str, limit: float) -> None:
        left = self.deadline - time.perf_counter()
        if left < 10:
            result: dict[str, Any] = {"ok": False, "error": "not run: the budget was spent"}
        else:
            timeout = min(limit, left)
            start = time.perf_counter()
            try:
                result = STEP_FUNCTIONS[name](self, timeout)
            except Exception as exc:  # a step's own failure is its result, never the end of the check
                result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            result.setdefault("seconds", time.perf_counter() - start)
            result["budget_s"] = timeout
        self.summary["steps"][name] = result
        self.write()
        note = result.get("error") or result.get("skipped") or "; ".join(result.get("problems") or [])
        print(
            f"  {name}: {'ok' if result.get('ok') else 'FAILED'} ({result.get('seconds', 0):.1f} s) {note}".rstrip(),
            flush=True,
        )


def run_json(check: Check, args: list[str], timeout: float) -> dict[str, Any]:
    """A sub-step in a fresh interpreter (bounded, isolated from CUDA state); its last stdout line is JSON."""
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            args, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=check.env()
        )
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"timed out after {timeout:.0f} s", "seconds": timeout}
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


def step_bundle(check: Check, timeout: float) -> dict[str, Any]:
    wheels = sorted((REPO / ".whl").glob("*.whl"))
    if not wheels:
        return {"ok": True, "skipped": "no .whl/ bundle: the interpreter's own packages are used"}
    manifest_path = REPO / ".whl" / "bundle.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    built_for = manifest.get("python_version")
    if built_for and built_for != here:
        result = {"ok": check.cpu, "python": here, "built_for": built_for}
        return {
            **result,
            ("skipped" if check.cpu else "error"): f".whl/ was built for Python {built_for}, this is {here}",
        }
    site = tempfile.mkdtemp(prefix="pd-dflash-bundle-")
    atexit.register(shutil.rmtree, site, ignore_errors=True)
    args = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
    args += ["--no-cache-dir", "--target", site, *map(str, wheels)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    if proc.returncode != 0:
        return {"ok": False, "error": f"pip install --no-index: {proc.stderr[-1500:]}"}
    check.site = site
    out: dict[str, Any] = {"ok": True, "site": site, "wheels": [w.name for w in wheels], "python": here}
    cache = Path(os.environ.get("PD_DFLASH_CACHE", "")) / "bundle.json"
    if cache.is_file():  # the trained presets: keyed for the torch named when the bundle was built
        out["cache"] = {k: v for k, v in json.loads(cache.read_text()).items() if k != "artifacts"}
    return out


def _pytest(check: Check, files: tuple[str, ...], timeout: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        junit, figures = Path(tmp) / "junit.xml", Path(tmp) / "figures.jsonl"
        args = [sys.executable, "-m", "pytest", *files, "-m", "gpu", "-q", "-p", "no:cacheprovider"]
        args.append(f"--junitxml={junit}")
        env = {**check.env(), "PD_DFLASH_GPU_FIGURES": str(figures)}
        start = time.perf_counter()
        try:
            proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)
        except subprocess.TimeoutExpired as exc:  # what pytest printed until then says how far it got
            printed = (
                exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
            )
            return {
                "ok": False,
                "error": f"pytest timed out after {timeout:.0f} s",
                "files": list(files),
                "tail": printed[-1500:],
                **_figures(figures),
            }
        out: dict[str, Any] = {
            "files": list(files),
            "exit_code": proc.returncode,
            "seconds": time.perf_counter() - start,
        }
        if junit.exists():
            suite = ET.parse(junit).getroot()
            suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
            out["junit"] = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
        out["tail"] = proc.stdout[-1500:]
        out.update(_figures(figures))
        # Every file collected (a collection error exits 2) and nothing failed.
        out["ok"] = proc.returncode == 0 and out.get("junit", {}).get("tests", 0) > 0
        return out


def _figures(path: Path) -> dict[str, Any]:
    """What the GPU tests measured (``record_figure`` in tests/engine/reference/helpers.py), if any."""
    if not path.exists():
        return {}
    return {"figures": [json.loads(line) for line in path.read_text().splitlines() if line.strip()]}


def _steps_call(check: Check, step: str, timeout: float) -> dict[str, Any]:
    script = str(REPO / "benchmarks" / "gpu_steps.py")
    return run_json(
        check,
        [sys.executable, script, step, "--device", check.device, "--budget-s", f"{timeout - 5:.0f}"],
        timeout,
    )


def step_overhead(check: Check, timeout: float) -> dict[str, Any]:
    """The hot-path benchmark at real shapes (its JSON is rewritten after every row: a timeout keeps the rows
    measured so far, ``status: running``)."""
    if not OVERHEAD.is_file():
        return {"ok": True, "skipped": f"not available: {OVERHEAD.relative_to(REPO)} is not in this checkout"}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "overhead.json"
        args = [sys.executable, str(OVERHEAD), *OVERHEAD_ARGS[check.device], "--json", str(path)]
        out: dict[str, Any] = {"command": " ".join(["benchmarks/engine_overhead.py", *args[2:]])}
        error = _run_json_script(
            check, args, path, out, timeout, tail=1500, kept="the rows measured until then are kept"
        )
        out["ok"] = error is None and out.get("result", {}).get("status") == "complete"
        if not out["ok"]:
            out["error"] = error or "no complete JSON written"
        return out


def _run_json_script(
    check: Check, args: list[str], path: Path, out: dict[str, Any], timeout: float, *, tail: int, kept: str
) -> str | None:
    """Run a benchmark script that rewrites its JSON ``path`` as it measures: its exit code, stdout tail, seconds
    and that JSON (whatever it holds when the script ends or is killed at ``timeout``) go into ``out``; returns
    the error, or None."""
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            args, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=check.env()
        )
        out.update(exit_code=proc.returncode, tail=proc.stdout[-tail:])
        error = proc.stderr[-1500:] if proc.returncode else None
    except subprocess.TimeoutExpired:
        error = f"timed out after {timeout:.0f} s ({kept})"
    out["seconds"] = time.perf_counter() - start
    if path.is_file():
        out["result"] = json.loads(path.read_text())
    return error


def step_real_size(check: Check, timeout: float) -> dict[str, Any]:
    """Both targets at their published width (``gpu_size.py``): its JSON is rewritten after every measurement and
    it stops starting cells before its own budget (10 s under this step's), so a timeout keeps what it measured."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "real_size.json"
        args = [sys.executable, str(REAL_SIZE), "--device", check.device, "--json", str(path)]
        args += ["--budget-s", f"{max(5.0, timeout - 10):.0f}"]
        out: dict[str, Any] = {"command": " ".join(["benchmarks/gpu_size.py", *args[2:3], check.device])}
        error = _run_json_script(
            check, args, path, out, timeout, tail=800, kept="what was measured until then is kept"
        )
        result = out.get("result", {})
        out["ok"] = error is None and result.get("status") == "complete" and result.get("ok") is True
        if not out["ok"]:
            out["error"] = (
                error
                or "; ".join(
                    f"{name}: {t.get('error') or 'a cell not OK'}"
                    for name, t in result.get("targets", {}).items()
                )
                or "no complete JSON written"
            )
        return out


def _real(check: Check, step: str, timeout: float) -> dict[str, Any]:
    script = str(REPO / "benchmarks" / "gpu_real.py")
    return run_json(check, [sys.executable, script, "--step", step, "--device", check.device], timeout)


STEP_FUNCTIONS = {
    "bundle": step_bundle,
    "preflight": lambda check, t: _steps_call(check, "preflight", t),
    "link_tests": lambda check, t: _pytest(check, LINK_TESTS, t),
    "configurations": lambda check, t: _steps_call(check, "configurations", t),
    "configuration_tests": lambda check, t: _pytest(check, CONFIGURATION_TESTS, t),
    "overhead": step_overhead,
    "pinning": lambda check, t: _steps_call(check, "pinning", t),
    "real_size": step_real_size,
    "real_slice": lambda check, t: _real(check, "slice", t),
    "real_target": lambda check, t: _real(check, "real", t),
}


class BadArguments(ValueError):
    """An argument the check refuses: the summary says why and the exit code is 2."""


def _wanted(text: str | None) -> list[str]:
    if text is None:
        return list(STEPS)
    names = [s.strip() for s in text.split(",") if s.strip()]
    known = {**STEPS, **EXTRA_STEPS}
    unknown = [s for s in names if s not in known]
    if unknown or not names:
        raise BadArguments(
            f"--steps: unknown step(s) {', '.join(unknown) or repr(text)}; use {', '.join(known)}"
        )
    return [s for s in known if s in names]


def _budget(value: float | None, cpu: bool) -> float:
    factor = CPU_BUDGET_FACTOR if cpu else 1
    if value is None:
        return factor * sum(STEPS.values())
    low, high = BUDGET_RANGE_S
    if not low <= value <= high:  # NaN fails too
        raise BadArguments(f"--budget-s must be from {low:g} to {high:g} seconds, got {value!r}")
    return value


def _refuse(output: Path, why: str) -> int:
    """Bad input: the summary says why (nothing else runs), exit 2."""
    print(f"gpu_check: {why}", file=sys.stderr)
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(
            json.dumps({"ok": False, "error": f"gpu_check: {why}", "steps": {}}, indent=2) + "\n"
        )
    except OSError as exc:
        print(f"gpu_check: could not write {output}: {exc}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--output", help="summary JSON path (default: $OUT/gpu_check.json or ./gpu_check.json)"
    )
    parser.add_argument("--cpu", action="store_true", help="every step's CPU-runnable part (no CUDA needed)")
    parser.add_argument(
        "--steps", help=f"comma-separated steps (default: {','.join(STEPS)}; also {','.join(EXTRA_STEPS)})"
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        help=f"overall seconds (default {sum(STEPS.values()):g}; --cpu: × {CPU_BUDGET_FACTOR})",
    )
    args = parser.parse_args(argv)
    output = Path(args.output or Path(os.environ.get("OUT", ".")) / "gpu_check.json")
    try:
        wanted, budget = _wanted(args.steps), _budget(args.budget_s, args.cpu)
    except BadArguments as exc:
        return _refuse(output, str(exc))
    factor = CPU_BUDGET_FACTOR if args.cpu else 1
    check = Check(output, "cpu" if args.cpu else "cuda", budget, args.cpu)
    print(f"gpu check ({check.summary['mode']}): {', '.join(wanted)} -> {output}", flush=True)
    check.summary["step_budgets_s"] = {name: factor * {**STEPS, **EXTRA_STEPS}[name] for name in wanted}
    check.write()
    limits = {**STEPS, **EXTRA_STEPS}
    for name in wanted:
        check.run_step(name, factor * limits[name])
    check.write()
    print(
        f"gpu check: {'ok' if check.summary['ok'] else 'FAILED'} in {check.summary['seconds']:.0f} s -> {output}"
    )
    return 0 if check.summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
