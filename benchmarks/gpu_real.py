"""The real-target steps of the GPU check (``benchmarks/gpu_check.py`` runs each in a fresh interpreter; the
last stdout line is a JSON result):

- ``tiny``: the tiny real-layout targets (Qwen3-MoE hub layout bf16; gpt-oss with MXFP4 experts) through
  ``ReferenceEngine`` on the device with their ``tiny-real-dflash`` drafter: B0 with a 25 % expert cache and B0
  with a 90 % one generate identical tokens at c = 1 and 4 (same decoding, same shapes: the only
  comparison that must be exact on a GPU), B3 (speculative, resident) runs OK, the host store is pinned, MXFP4
  parts are moved as stored and dequantised on the device.
- ``slice``: a real-shaped one-layer slice of each target (``benchmarks/load.py``'s writer: 128 Qwen3-Coder
  experts of 9,437,184 B; 32 gpt-oss-20b MXFP4 experts of 13,236,480 B), loaded into pinned memory; every
  expert of the layer is fetched through the engine's expert cache and CUDA link; transfer rate ÷ the pinned
  probe (target ≥ 0.9), plus the device dequantisation time of an MXFP4 expert and the pinned load's throughput
  ÷ a plain sequential read of the same files.
- ``real``: one B0 cell of a real target when its weights are under HF_HOME (skipped with a message otherwise).

Without CUDA ``tiny`` runs on the CPU (plumbing only) and ``slice``/``real`` say "skipped".

    python benchmarks/gpu_real.py --step tiny|slice|real [--device cuda|cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
REAL_TARGETS = ("openai/gpt-oss-20b", "Qwen/Qwen3-Coder-30B-A3B-Instruct")


def _spec(
    model: dict, device: str, workload: dict, baselines=("B0", "B3"), concurrency=(1, 4), fraction=0.25
):
    from pd_dflash.spec import parse_spec

    return parse_spec(
        {
            "name": "gpu-real",
            "engine": "reference",
            "models": [model],
            "baselines": list(baselines),
            "block_sizes": [8],
            "concurrency": list(concurrency),
            "repeats": 1,
            "workload": workload,
            "memory": {"expert_cache_fraction": fraction},
            "hardware": {"device": device, "accelerator_type": None, "compute_capability": None},
        }
    )


def _engine(spec, device: str):
    from pd_dflash.engine.interface import EngineContext
    from pd_dflash.engine.reference.engine import ReferenceEngine

    return ReferenceEngine(EngineContext.for_model(spec, device="cuda:0" if device == "cuda" else "cpu"))


def _cells(engine, spec) -> list[dict[str, Any]]:
    """Each cell's summary; a refusal is recorded as the sweep's runner records it (its status and reason)."""
    from pd_dflash.engine.interface import Refused
    from pd_dflash.schema import EngineResult
    from pd_dflash.spec import expand

    out = []
    for cell in expand(spec):
        try:
            r = engine.run_cell(cell)
        except Refused as refusal:
            r = EngineResult(status=refusal.status, reason=refusal.reason)
        terms = r.cost_terms.model_dump(exclude_none=True) if r.cost_terms is not None else {}
        out.append(
            {
                "baseline": cell.baseline,
                "concurrency": cell.concurrency,
                "status": r.status.value,
                "reason": r.reason,
                "output_digest": r.engine.get("output_digest"),
                "output_tokens_per_second": r.output_tokens_per_second,
                "h2d_bytes": terms.get("h2d_bytes"),
                "h2d_seconds": terms.get("h2d_seconds"),
            }
        )
    return out


def step_tiny(device: str) -> dict[str, Any]:
    import torch

    results, ok = {}, True
    workload = {"requests": 4, "warmup_rounds": 1, "max_new_tokens": 16, "prompt_tokens": 16}
    for name in ("tiny-real-qwen3-moe", "tiny-real-gpt-oss"):
        model = {"id": name, "draft": "tiny-real-dflash"}
        spec = _spec(model, device, workload)
        engine = _engine(spec, device)
        store = engine.store
        first = store.parts[store.layer_ids[0]]
        facts = {
            "storage_dtype": engine.describe()["storage_dtype"],
            "expert_nbytes": store.expert_nbytes,
            "store_pinned": all(t.is_pinned() for t in first) if device == "cuda" else None,
        }
        if store.storage == "mxfp4":  # dequantise one expert on the device: the device tensors come back
            slot = [t.to(engine.device) for t in store.payload(store.layer_ids[0], 0)]
            weights = store.dequantize(slot, engine.compute_dtype)
            facts["dequantised_on"] = sorted({str(w.device) for w in weights})
        cells = _cells(engine, spec)
        engine.close()
        cached = _spec(model, device, workload, baselines=("B0",), fraction=0.9)  # nearly every expert cached
        engine = _engine(cached, device)
        full = {c["concurrency"]: c["output_digest"] for c in _cells(engine, cached)}
        engine.close()
        digests = {(c["baseline"], c["concurrency"]): c["output_digest"] for c in cells}
        checks = {f"cache_25pct_equals_90pct_c{c}": digests[("B0", c)] == full[c] for c in (1, 4)}
        good = all(checks.values()) and all(c["status"] == "OK" for c in cells)
        if device == "cuda":
            good = good and facts["store_pinned"] and facts.get("dequantised_on", ["cuda:0"]) == ["cuda:0"]
        results[name] = {"ok": good, **facts, "checks": checks, "cells": cells}
        ok = ok and good
    return {"ok": ok, "device": device, "torch": torch.__version__, "targets": results}


def step_slice(device: str) -> dict[str, Any]:
    import torch

    if device != "cuda":
        return {"ok": True, "skipped": "no CUDA device"}
    from load import child_read, write_slice

    from pd_dflash.engine.probe import measure_h2d_bytes_per_second
    from pd_dflash.engine.reference.checkpoints.loader import load_checkpoint
    from pd_dflash.engine.reference.offload.cache import ExpertCache
    from pd_dflash.engine.reference.offload.cuda_link import CudaLink

    dev = torch.device("cuda:0")
    probe = measure_h2d_bytes_per_second(dev)
    out: dict[str, Any] = {"probe_bytes_per_second": probe, "targets": {}}
    ok = True
    for target in ("qwen3-coder", "gpt-oss"):
        with tempfile.TemporaryDirectory() as tmp:
            directory = Path(tmp) / target
            nbytes = write_slice(target, directory, layers=1)
            read = child_read(directory)  # the plain sequential read of the same files (page cache warm)
            start = time.perf_counter()
            loaded = load_checkpoint(target, str(directory), device=dev, pin=True)
            load_seconds = time.perf_counter() - start
        store = loaded.store
        compute = next(loaded.model.parameters()).dtype
        rates = []
        for _ in range(3):  # every expert of the layer through a cache that holds them all, fresh each time
            cache = ExpertCache(store, store.total_bytes, dev, compute, link=CudaLink(dev))
            for e in range(store.num_experts):
                cache.release(cache.acquire((store.layer_ids[0], e)))
            cache.drain()
            rates.append(cache.counters.h2d_bytes / cache.counters.h2d_seconds)
            cache.close()
        entry = {
            "checkpoint_bytes": nbytes,
            "load_seconds": load_seconds,
            "load_over_sequential_read": (nbytes / load_seconds) / (read["bytes"] / read["seconds"]),
            "storage": store.storage,
            "expert_nbytes": store.expert_nbytes,
            "transfer_bytes_per_second": max(rates),
            "transfer_over_probe": max(rates) / probe,
        }
        if store.storage == "mxfp4":
            slot = [t.to(dev) for t in store.payload(store.layer_ids[0], 0)]
            store.dequantize(slot, compute)
            torch.cuda.synchronize(dev)
            start = time.perf_counter()
            for _ in range(20):
                store.dequantize(slot, compute)
            torch.cuda.synchronize(dev)
            entry["dequantise_seconds_per_expert"] = (time.perf_counter() - start) / 20
        entry["ok"] = entry["transfer_over_probe"] >= 0.9
        ok = ok and entry["ok"]
        out["targets"][target] = entry
        del loaded, store
        torch.cuda.empty_cache()
    return {"ok": ok, **out}


def step_real(device: str) -> dict[str, Any]:
    from pd_dflash.engine.reference.checkpoints.resolve import hub_cache, resolve

    found = [(t, resolve(t)) for t in REAL_TARGETS]
    present = [(t, r) for t, r in found if r.directory is not None]
    if not present:
        return {
            "ok": True,
            "skipped": f"no real target under HF_HOME ({hub_cache()}): {', '.join(REAL_TARGETS)}",
        }
    if device != "cuda":
        return {"ok": True, "skipped": "no CUDA device"}
    target, _ = present[0]
    workload = {"requests": 2, "warmup_rounds": 1, "max_new_tokens": 16, "prompts": "humaneval"}
    spec = _spec({"id": target}, device, workload, baselines=("B0",), concurrency=(1,))
    start = time.perf_counter()
    engine = _engine(spec, device)
    load_seconds = time.perf_counter() - start
    cells = _cells(engine, spec)
    return {
        "ok": all(c["status"] == "OK" for c in cells),
        "target": target,
        "load_seconds": load_seconds,
        "engine": {
            k: engine.describe().get(k) for k in ("storage_dtype", "expert_nbytes", "total_expert_bytes")
        },
        "cells": cells,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step", choices=("tiny", "slice", "real"), required=True)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = parser.parse_args()
    step = {"tiny": step_tiny, "slice": step_slice, "real": step_real}[args.step]
    print(json.dumps(step(args.device), default=str))


if __name__ == "__main__":
    main()
