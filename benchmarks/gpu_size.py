"""The GPU check's ``real_size`` step: both Phase-A targets at their published width, through the engine itself.

Per target, a checkpoint at the published shapes (``benchmarks/load.py``'s writer: the published config.json with
the layer count cut, full vocabulary, random but well-scaled weights; Qwen3-Coder-30B-A3B: hidden 2048, 128
experts of moe_intermediate 768, top-8, bf16 → 9,437,184 B per expert; gpt-oss-20b: hidden 2880, 32 experts,
top-4, MXFP4 experts moved as stored) and a random DFlash drafter in z-lab's layout (``dflash/tiny.py``) are
written into a scratch directory (``/dev/shm`` when it has room), then loaded by the engine's own loader into the
pinned host store. Depth: the published one where ``--max-expert-gib`` and the host's available memory allow,
else as many layers as fit, with the factor (published ÷ measured layers) in the JSON. The engine's
``load_checkpoint`` reads checkpoints only, so "random weights" means random files in RAM-backed scratch, not
tensors made on the device.

Measured through ``ReferenceEngine.run_cell`` (the runner's path), B0, B3 and OURS at c = 1 and 4, B = 16,
expert cache 25 %: ms per token and per verify round; per round t_fetch of the misses (the hide inequality's
(1−r)·s·M/BW, and the link seconds measured), t_draft, t_router, t_verify, the hide window and margin; H2D
GB/s at the real expert size ÷ the probe; host syncs per token (the engine's own counter) and the
expert-compute path the row records. ONE cell per target (OURS, c = 4) is also run under the op counter (ops
and host syncs per token, ``engine_overhead.py``'s) and, on CUDA, under the profiler (GPU busy fraction): the
other cells are timed only, so the step cannot overrun by profiling. Then bf16 grouped GEMM against the
gathered bmm at the real expert dimensions (gate_up of c = 4 × (B + 1) × k pairs over a 25 % slot pool).

Random weights make acceptance (τ) and route-ahead coverage meaningless: τ is recorded as observed and the JSON
says so. The JSON (``--json``) is rewritten after every measurement, and the step stops starting cells when its
``--budget-s`` is nearly spent, so a kill at the limit keeps what was measured (``status: running``).

    python benchmarks/gpu_size.py --device cuda|cpu --json PATH [--budget-s S] [--layers N] [--max-expert-gib G]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

#: name → (benchmarks/load.py's slice key, published MoE depth)
TARGETS = {"qwen3-coder-30b-a3b": ("qwen3-coder", 48), "gpt-oss-20b": ("gpt-oss", 24)}
BASELINES, CONCURRENCY, BLOCK_SIZE, CACHE_FRACTION = ("B0", "B3", "OURS"), (1, 4), 16, 0.25
#: The one cell per target that is counted and profiled.
COUNTED = ("OURS", 4)
#: The order cells run in: where the budget ends early, the offloaded speculative cell has been measured.
ORDER = (("B0", 1), ("OURS", 4), ("B3", 4), ("B0", 4), ("OURS", 1), ("B3", 1))
RANDOM_WEIGHTS = (
    "random weights: acceptance (tau) and route-ahead coverage are meaningless here (recorded as observed); "
    "the sizes, bytes moved, times and op counts are the real shapes'"
)
#: Seconds kept back at the end: a cell is not started unless this much of the budget is left beyond its
#: estimate (the first cell's time).
RESERVE_S = 5.0


class Report:
    """The step's JSON, rewritten atomically after every measurement."""

    def __init__(self, path: Path | None, device: str, budget_s: float) -> None:
        self.path, self.start = path, time.perf_counter()
        self.deadline = self.start + budget_s
        self.data: dict[str, Any] = {
            "status": "running",
            "device": device,
            "budget_s": budget_s,
            "random_weights": RANDOM_WEIGHTS,
            "block_size": BLOCK_SIZE,
            "expert_cache_fraction": CACHE_FRACTION,
            "targets": {},
        }

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def write(self) -> None:
        self.data["seconds"] = time.perf_counter() - self.start
        if self.path is not None:
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text(json.dumps(self.data, indent=1, default=str) + "\n")
            os.replace(tmp, self.path)


def choose_layers(expert_bytes_per_layer: int, published: int, cap_bytes: int, available: int | None) -> int:
    """The depth to build: published, else what fits both the cap and a third of the available host memory (the
    scratch files, the pinned arena and the page cache each hold the experts once)."""
    room = cap_bytes if available is None else min(cap_bytes, available // 3)
    return max(1, min(published, room // expert_bytes_per_layer))


def host_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def scratch_root(need: int) -> str | None:
    """``/dev/shm`` when it can hold ``need`` bytes with room to spare, else the default temporary directory."""
    try:
        if shutil.disk_usage("/dev/shm").free > 2 * need:
            return "/dev/shm"
    except OSError:
        pass
    return None


def write_target(slice_key: str, directory: Path, layers: int) -> tuple[Path, Path, int]:
    """(target, drafter, checkpoint bytes): the real-width slice and a random B = 16 DFlash drafter."""
    from load import slice_config, write_slice

    from pd_dflash.engine.reference.dflash.tiny import tiny_drafter_config, write_tiny_drafter

    target = directory / "target"
    nbytes = write_slice(slice_key, target, layers=layers)
    config = tiny_drafter_config(slice_config(slice_key, layers), block_size=BLOCK_SIZE)
    drafter = write_tiny_drafter(directory / "drafter", config, seed=0)
    return target, drafter, nbytes


def spec_for(name: str, target: Path, drafter: Path, device: str, gbps: float):
    from pd_dflash.spec import parse_spec

    # CPU: fp32 compute (CPU bf16 GEMMs are many times slower than fp32 ones); experts stay stored as published.
    options: dict[str, Any] = {} if device == "cuda" else {"emulated_h2d_gbps": gbps, "dtype": "fp32"}
    hardware: dict[str, Any] = {"device": device, "cpus_per_runner": 1}
    if device == "cuda":
        hardware.update(accelerator_type=None, compute_capability=None)
    new_tokens = 32 if device == "cuda" else 2
    return parse_spec(
        {
            "name": "gpu-check-real-size",
            "engine": "reference",
            "models": [
                {
                    "id": f"real-size-{name}",
                    "path": str(target),
                    "draft": str(drafter),
                    "engine_options": options,
                }
            ],
            "baselines": list(BASELINES),
            "block_sizes": [BLOCK_SIZE],
            "concurrency": list(CONCURRENCY),
            "repeats": 1,
            "workload": {
                "requests": max(CONCURRENCY),
                "warmup_rounds": 1 if device == "cuda" else 0,  # a warm-up request decodes B tokens
                "max_new_tokens": new_tokens,
                "prompt_tokens": 32 if device == "cuda" else 8,
                "seed": 1408,
            },
            "memory": {"expert_cache_fraction": CACHE_FRACTION},
            "hardware": hardware,
        }
    )


def cell_figures(result, cap, probe: float | None) -> dict[str, Any]:
    """One cell's figures from its row and its timed loop's rounds (``engine_overhead.py``'s timing figures)."""
    import engine_overhead as eo

    out = eo._timing_figures(result, cap)
    verify = eo._verify_rounds(cap.rounds)
    terms = result.cost_terms.model_dump(exclude_none=True) if result.cost_terms is not None else {}
    hide = result.hide_inequality
    rounds = len(verify) or None
    out["hide_terms"] = {
        "t_fetch_s": hide.fetch_seconds if hide else None,
        "t_fetch_link_measured_s": terms["h2d_seconds"] / rounds
        if rounds and "h2d_seconds" in terms
        else None,
        "t_draft_s": statistics.mean(r.draft_seconds for r in verify) if verify else None,
        "t_router_s": statistics.mean(r.router_seconds for r in verify) if verify else None,
        "t_verify_s": statistics.mean(r.forward_seconds for r in verify) if verify else None,
        "hide_window_s": hide.hide_window_seconds if hide else None,
        "margin_s": hide.margin_seconds if hide else None,
        "hidden": hide.hidden if hide else None,
        "resident_fraction": hide.resident_fraction if hide else None,
        "saturation": hide.saturation if hide else None,
    }
    if hide is None:
        out["hide_terms"]["absent"] = "no hide inequality in the row (no link bandwidth, or nothing fetched)"
    h2d_bytes, h2d_seconds = terms.get("h2d_bytes"), terms.get("h2d_seconds")
    out["h2d"] = {"bytes": h2d_bytes, "seconds": h2d_seconds, "link": terms.get("h2d_link")}
    if h2d_bytes and h2d_seconds:
        rate = h2d_bytes / h2d_seconds
        out["h2d"].update(bytes_per_second=rate, over_probe=rate / probe if probe else None)
    out["tau_observed"] = result.acceptance_length_a
    out["expert_compute"] = result.engine.get("expert_compute")
    syncs = result.engine.get("host_syncs") or {}
    out["host_syncs_per_token"] = syncs.get("per_generated_token")
    out["status"], out["reason"] = result.status.value, result.reason
    return out


def counted_cell(engine, cell, device, profile: bool) -> dict[str, Any]:
    """The op counter's run (ops and syncs per token) and, on CUDA, the profiler's (busy fraction) of one cell."""
    import engine_overhead as eo

    eo._DEVICE = device
    with eo.timed_loop(engine, device, count=True) as box:
        result = engine.run_cell(cell)
    moe_layers = int(engine.describe()["moe_layers"])
    out = eo._count_figures(box["capture"], result, moe_layers=moe_layers)
    if profile:
        with eo.timed_loop(engine, device, count=False, profile=True) as box:
            engine.run_cell(cell)
        out["gpu_busy_fraction"] = box["capture"].busy_fraction
    return out


def measure_target(report: Report, name: str, args, device) -> None:
    import engine_overhead as eo

    from pd_dflash.engine.interface import EngineContext, Refused
    from pd_dflash.engine.reference.engine import ReferenceEngine
    from pd_dflash.schema import EngineResult
    from pd_dflash.spec import expand

    slice_key, published = TARGETS[name]
    entry: dict[str, Any] = {"published_layers": published, "cells": []}
    report.data["targets"][name] = entry
    per_layer = layer_expert_bytes(slice_key)
    cap = int(args.max_expert_gib * 2**30)
    layers = args.layers or choose_layers(per_layer, published, cap, host_available())
    entry.update(layers=layers, depth_factor=published / layers, expert_bytes_per_layer=per_layer)
    entry["expert_nbytes_published_layout"] = per_layer // _experts(slice_key)
    print(f"real_size {name}: {layers} of {published} layers (x{published / layers:.2f})", flush=True)
    with tempfile.TemporaryDirectory(
        prefix="pd-dflash-real-size-", dir=scratch_root(layers * per_layer) if device.type == "cuda" else None
    ) as tmp:
        entry["scratch"] = tmp  # recorded first: a parent that kills this child removes it
        report.write()
        start = time.perf_counter()
        target, drafter, nbytes = write_target(slice_key, Path(tmp), layers)
        entry.update(checkpoint_bytes=nbytes, write_seconds=time.perf_counter() - start)
        report.write()
        spec = spec_for(name, target, drafter, args.device, args.link_gbps)
        start = time.perf_counter()
        engine = ReferenceEngine(EngineContext.for_model(spec, device=str(device)))
        entry["load_seconds"] = time.perf_counter() - start
        facts = engine.describe()
        entry["engine"] = {
            k: facts.get(k)
            for k in (
                "storage_dtype",
                "dtype",
                "expert_nbytes",
                "total_expert_bytes",
                "moe_layers",
                "load_refused",
            )
        }
        entry["engine"]["h2d_probe_bytes_per_second"] = probe = facts.get("h2d_probe_bytes_per_second")
        if engine.store is not None and device.type == "cuda":
            first = engine.store.parts[engine.store.layer_ids[0]]
            entry["engine"]["store_pinned"] = all(t.is_pinned() for t in first)
        report.write()
        estimate = 0.0
        cells = {(c.baseline, c.concurrency): c for c in expand(spec)}
        cells = {key: cells[key] for key in ORDER if key in cells}
        for (baseline, c), cell in cells.items():
            if report.left() < estimate + RESERVE_S:
                entry["cells"].append({"baseline": baseline, "concurrency": c, "not_run": "budget spent"})
                continue
            start = time.perf_counter()
            try:
                with eo.timed_loop(engine, device, count=False) as box:
                    result = engine.run_cell(cell)
                figures = cell_figures(result, box["capture"], probe) if "capture" in box else {}
            except Refused as refusal:
                result = EngineResult(status=refusal.status, reason=refusal.reason)
                figures = {"status": result.status.value, "reason": result.reason}
            seconds = time.perf_counter() - start
            estimate = max(estimate, seconds)
            entry["cells"].append({"baseline": baseline, "concurrency": c, "seconds": seconds, **figures})
            report.write()
        done = {(e["baseline"], e["concurrency"]): e for e in entry["cells"]}
        if done.get(COUNTED, {}).get("status") == "OK":
            if report.left() > 2 * (done[COUNTED]["seconds"] + RESERVE_S) + (
                RESERVE_S if device.type == "cuda" else 0
            ):
                entry["counted"] = {
                    "cell": list(COUNTED),
                    **counted_cell(engine, cells[COUNTED], device, device.type == "cuda"),
                }
            else:
                entry["counted"] = {"cell": list(COUNTED), "not_run": "budget spent"}
        engine.close()
        del engine
    entry["grouped_gemm_vs_gathered_bmm"] = gemm_compare(slice_key, device)
    report.write()


def _experts(slice_key: str) -> int:
    from load import slice_config

    config = slice_config(slice_key, 1)
    return int(config.get("num_experts") or config["num_local_experts"])


def layer_expert_bytes(slice_key: str) -> int:
    """One MoE layer's expert bytes as stored (the layout the engine loads)."""
    from load import slice_config

    from pd_dflash.engine.reference.families import expert_layout

    layout = expert_layout(slice_config(slice_key, 1))
    return layout.num_experts * layout.expert_nbytes


def gemm_compare(slice_key: str, device) -> dict[str, Any]:
    """bf16 gate_up of c·(B + 1)·k (token, expert) pairs over a 25 % slot pool at the real dimensions: torch's
    ``_grouped_mm`` against the gathered bmm (each pair's weights gathered, one bmm). On CUDA 20 timed
    repetitions, on the CPU 1 at c = 1 (the gathered weights are pairs × one expert's matrix)."""
    import torch
    from load import slice_config

    config = slice_config(slice_key, 1)
    hidden = int(config["hidden_size"])
    inter = int(config.get("moe_intermediate_size") or config["intermediate_size"])
    experts = int(config.get("num_experts") or config["num_local_experts"])
    top_k = int(config["num_experts_per_tok"])
    cuda = device.type == "cuda"
    c = 4 if cuda else 1
    pairs, slots = c * (BLOCK_SIZE + 1) * top_k, max(1, experts // 4)
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(pairs, hidden, dtype=torch.bfloat16, device=device, generator=gen)
    w = torch.randn(slots, hidden, 2 * inter, dtype=torch.bfloat16, device=device, generator=gen) * 0.02
    slot = torch.randint(0, slots, (pairs,), device=device, generator=gen).sort().values
    offs = torch.bincount(slot, minlength=slots).cumsum(0).to(torch.int32)
    out: dict[str, Any] = {"pairs": pairs, "slots": slots, "shape": [hidden, 2 * inter], "concurrency": c}
    out["gathered_bytes"] = pairs * hidden * 2 * inter * 2
    reps = 20 if cuda else 1
    runs = {"grouped_mm": lambda: torch._grouped_mm(x, w, offs=offs)}
    runs["gathered_bmm"] = lambda: torch.bmm(x[:, None], w[slot])[:, 0]
    results = {}
    for kind, fn in runs.items():
        try:
            results[kind] = fn()  # warm-up (and the outputs compared below)
            if cuda:
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            for _ in range(reps):
                fn()
            if cuda:
                torch.cuda.synchronize(device)
            out[f"{kind}_ms"] = (time.perf_counter() - start) * 1e3 / reps
        except (RuntimeError, MemoryError) as exc:
            out[f"{kind}_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    if len(results) == 2:
        a, b = (results[k].float() for k in ("grouped_mm", "gathered_bmm"))
        out["max_abs_difference"] = float((a - b).abs().max())
    if "grouped_mm_ms" in out and "gathered_bmm_ms" in out:
        out["gathered_over_grouped"] = out["gathered_bmm_ms"] / out["grouped_mm_ms"]
    if cuda:
        from pd_dflash.engine.reference.offload.grouped import cuda_choice

        out["engine_path"] = cuda_choice(device, torch.bfloat16)["path"]
    return out


def run_target(name: str, share: float, argv: list[str]) -> dict[str, Any]:
    """One target in a child interpreter, killed at its share of the budget (a cell's time cannot be known before
    it runs: the first speculative cell also loads the drafter); what the child wrote until then is kept, and
    every cell it did not finish is said not run."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "target.json"
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            *_without(argv, "--json", "--budget-s", "--targets"),
        ]
        cmd += ["--json", str(path), "--budget-s", f"{share - 2 * RESERVE_S:.0f}", "--one-target", name]
        stopped, error = None, None
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=share)
            if proc.returncode != 0:
                error = f"exit {proc.returncode}: {proc.stderr[-1500:]}"
        except subprocess.TimeoutExpired:
            stopped = f"the target's share of the budget ({share:.0f} s) ended while it ran"
        entry = json.loads(path.read_text())["targets"].get(name, {}) if path.is_file() else {}
    if error:
        entry.setdefault("error", error)
    if stopped:
        entry["stopped"] = stopped
        if entry.get("scratch"):
            shutil.rmtree(entry["scratch"], ignore_errors=True)  # the killed child could not clean up
    done = {(c["baseline"], c["concurrency"]) for c in entry.setdefault("cells", [])}
    for b in BASELINES:
        for c in CONCURRENCY:
            if (b, c) not in done:
                entry["cells"].append({"baseline": b, "concurrency": c, "not_run": "budget spent"})
    return entry


def _without(argv: list[str], *options: str) -> list[str]:
    """``argv`` less the named options and their values (``--targets`` takes several)."""
    out, dropping = [], None
    for a in argv:
        if a in options:
            dropping = a
        elif dropping and not a.startswith("--"):
            if dropping != "--targets":
                dropping = None
        else:
            dropping = None
            out.append(a)
    return out


def _target_ok(entry: dict[str, Any]) -> bool:
    """Measured without an error, and every cell that ran is OK (cells the budget left out are not failures)."""
    ran = [c for c in entry.get("cells", []) if "not_run" not in c]
    return "error" not in entry and bool(ran) and all(c.get("status") == "OK" for c in ran)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--json", type=Path, default=None, help="rewritten after every measurement")
    parser.add_argument("--budget-s", type=float, default=150.0)
    parser.add_argument("--targets", nargs="+", choices=tuple(TARGETS), default=list(TARGETS))
    parser.add_argument("--layers", type=int, default=None, help="the depth of every target (default: fits)")
    parser.add_argument(
        "--max-expert-gib",
        type=float,
        default=None,
        help="expert bytes built per target (CUDA 12, CPU: 2 layers)",
    )
    parser.add_argument("--link-gbps", type=float, default=55.0, help="CPU: the emulated link (PCIe 5 x16)")
    parser.add_argument("--one-target", choices=tuple(TARGETS), default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.layers is not None and args.layers < 1:
        parser.error("--layers must be >= 1")
    if args.device == "cpu" and args.layers is None:
        args.layers = 2  # the CPU run: real width, 2 layers per target
    if args.max_expert_gib is None:
        args.max_expert_gib = 12.0
    import torch

    device = torch.device("cuda:0" if args.device == "cuda" else "cpu")
    report = Report(args.json, args.device, args.budget_s)
    if args.one_target:  # the child: one target, in this interpreter, until its deadline
        try:
            measure_target(report, args.one_target, args, device)
        except Exception as exc:
            report.data["targets"].setdefault(args.one_target, {})["error"] = f"{type(exc).__name__}: {exc}"
        report.write()
        return 0
    report.write()
    end = report.deadline
    for i, name in enumerate(args.targets):
        share = (end - time.perf_counter()) / (len(args.targets) - i)
        if share < 4 * RESERVE_S:
            report.data["targets"][name] = {"not_run": "budget spent"}
        else:  # each target gets an equal share of what is left, enforced: the first cannot starve the second
            report.data["targets"][name] = run_target(name, share, argv or sys.argv[1:])
        report.write()
    report.data["ok"] = all(_target_ok(t) for t in report.data["targets"].values())
    report.data["status"] = "complete"
    report.write()
    print(json.dumps(report.data, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
