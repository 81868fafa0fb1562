"""What the hot path costs at the real targets' routing geometry: ops dispatched, host syncs and ms per generated
token and per verify forward, for transformers' own resident forward and for the reference engine's B0, B1, B3
and OURS, in one run; plus upstream's BM2 (saturated prefetch issuance) for this engine.

Checkpoints: tiny math (hidden 64, random weights) at the real routing geometry, in the published layouts, written
once into the engine cache (``$PD_DFLASH_CACHE/engine-overhead/``) by the project's own writers
(each family's ``write_tiny`` in ``families/``, ``dflash/tiny.py``):

- ``qwen3-coder-30b-a3b``: Qwen3-MoE hub layout in bf16, 48 layers × 128 experts, top-8, moe_intermediate 32;
- ``gpt-oss-20b``: gpt-oss as published (MXFP4 experts, bf16 rest), 24 layers × 32 experts, top-4.

Each gets a random DFlash drafter in z-lab's layout with ``block_size`` = B (default 16; τ ≈ 1: it tests
machinery, not acceptance).

Measured, per geometry (one request, 32-token prompt, 16 new tokens, greedy, unless changed):

- transformers (``AutoModelForCausalLM``, resident, MXFP4 dequantised at load by transformers): ``generate`` with
  ``set_experts_implementation("eager")`` and ``("grouped_mm")``, and ONE forward of the 16 generated tokens
  after the prompt's prefill (what a B = 16 verify computes);
- the reference engine through ``ReferenceEngine.run_cell`` on a spec, exactly as a runner drives it: B0, B1,
  B3 and OURS at c = 1 (offloaded ones: expert cache 25 % of the expert bytes; CPU: link emulated at 1000 GB/s,
  i.e. transfers ≈ free), and B0, B3 at c = 4 and 16 (requests = c). Only the cell's timed loop is measured
  (``ReferenceEngine._timed`` is wrapped: setup and warm-up are not counted).

Every figure comes from two runs of the same thing: a timing run (ms; nothing attached) and a counting run under
a ``TorchDispatchMode`` that counts every ``__torch_dispatch__`` call on the host thread (prefill included on
both sides) with its host-clock time, so ops are attributed to the engine's round windows (draft / router /
issue / verify, ``decoding/loop.RoundRecord.windows``). Host syncs: ``aten._local_scalar_dense`` (``.item()``),
device→host copies, and data-dependent-shape ops (``nonzero``, ``unique``, ``masked_select``: they synchronise
on CUDA); on CPU ``.tolist()`` does not reach the dispatcher, so the dispatch count is a lower bound there; the
engine's own ``engine.host_syncs`` row fact is copied when the engine reports it. On CUDA the synchronising
calls flagged by ``torch.cuda.set_sync_debug_mode("warn")`` are counted too, and a third run under
``torch.profiler`` gives the GPU busy fraction (Σ kernel time ÷ wall). For gpt-oss, the calls to the MXFP4
dequantisation function (``checkpoints.mxfp4.dequantize``) inside the timed loop are counted (resident B3: the
target is 0).

BM2 (upstream's ``bench_prefetch_issuance.py``, for this engine): the time to issue a prefetch of every expert
of every MoE layer (a saturated round: B·k ≥ E) on a fresh cache that can hold them all, with the engine's link
(emulated on CPU, ``CudaLink`` on CUDA), in two modes interleaved: ``python-per-expert`` (``ExpertCache.prefetch``
per expert) and ``batched`` (one ``ExpertCache.prefetch_many``: one link batch per layer); nearest-rank
p50/p90/p99 in µs against the window t_draft + t_router of the OURS c = 1 row; ``candidate_required`` = the
per-expert median > window and ``ship_batched`` = candidate_required and the batched median ≤ window
(upstream's rules).

BM3 (upstream's ``bench_prefetch_priority.py``): OURS with route-ahead's predictions in the link's band 0
(on-demand), 1 (route-ahead) or 2 (background, where route-ahead's end-of-verify history always goes), on a busy
link (CPU: emulated at ``--bm3-link-gbps``), a fresh cell per run (identical seeded requests, fresh cache);
median exposed fetch and tokens/s per arm and ``ship_priority_band`` (route-ahead exposed < background exposed,
route-ahead tok/s ≥ background tok/s, on-demand exposed ≤ both).

    .venv/bin/python benchmarks/engine_overhead.py --json engine_overhead.json        # both geometries, CPU
    .venv/bin/python benchmarks/engine_overhead.py --device cuda --layers 12 --json out.json
    .venv/bin/python benchmarks/engine_overhead.py --quick --json /tmp/quick.json      # CI smoke size
    .venv/bin/python benchmarks/engine_overhead.py --render engine_overhead.json      # the markdown again

The JSON is rewritten after every measured row (atomic replace), so a run killed at a time limit keeps what it
measured; ``status`` is "running" until the end, then "complete". The markdown tables (docs/engine-overhead.md)
are printed at the end and by ``--render``.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import hashlib
import json
import math
import os
import statistics
import sys
import time
import warnings
from array import array
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("PD_DFLASH_CACHE", str(REPO / ".cache" / "pd-dflash"))

BENCHMARK = "engine_overhead"
#: Bumped when the JSON's shape changes (tests/engine/reference/test_engine_overhead.py checks it).
SCHEMA_VERSION = 2


@dataclass(frozen=True)
class Geometry:
    """A real target's routing geometry, built in its published layout at tiny math."""

    name: str
    real_model: str
    layers: int
    experts: int
    top_k: int
    storage: str
    writer: str  # "qwen3_moe" | "gpt_oss"

    def overrides(self, layers: int) -> dict[str, Any]:
        experts_field = "num_experts" if self.writer == "qwen3_moe" else "num_local_experts"
        return {"num_hidden_layers": layers, experts_field: self.experts, "num_experts_per_tok": self.top_k}


GEOMETRIES = {
    "qwen3-coder-30b-a3b": Geometry(
        "qwen3-coder-30b-a3b", "Qwen/Qwen3-Coder-30B-A3B-Instruct", 48, 128, 8, "bf16", "qwen3_moe"
    ),
    "gpt-oss-20b": Geometry("gpt-oss-20b", "openai/gpt-oss-20b", 24, 32, 4, "mxfp4", "gpt_oss"),
}


# -- checkpoints -------------------------------------------------------------------------------------------------
def checkpoint(geo: Geometry, layers: int, block_size: int, cache_dir: str | None) -> tuple[Path, Path]:
    """(target, drafter) directories of a geometry, written once into the engine cache (lock-protected)."""
    from pd_dflash.engine.reference.checkpoints.tiny import TINY_CODE_FILES
    from pd_dflash.engine.reference.dflash.tiny import tiny_drafter_config, write_tiny_drafter
    from pd_dflash.engine.reference.families import gpt_oss, qwen3_moe
    from pd_dflash.engine.reference.presets.training import build_once, cache_root, code_version

    version = code_version((*TINY_CODE_FILES, "dflash/tiny.py"))
    root = cache_root(cache_dir) / "engine-overhead"
    target = root / f"{geo.name}-L{layers}-{version}"
    overrides = geo.overrides(layers)

    def build_target(tmp: Path) -> dict[str, Any]:
        if geo.writer == "qwen3_moe":
            card = qwen3_moe.FAMILY.write_tiny(tmp, 0, max_shard_size="50MB", **overrides)
        else:
            card = gpt_oss.FAMILY.write_tiny(tmp, 0, **overrides)
        return {**card, "geometry": geo.name, **overrides}

    build_once(target, build_target)
    config = tiny_drafter_config(json.loads((target / "config.json").read_text()), block_size=block_size)
    key = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:12]
    drafter = root / f"{geo.name}-L{layers}-{version}-dflash-{key}"
    build_once(drafter, lambda tmp: (write_tiny_drafter(tmp, config, seed=0), {"drafter": "tiny"})[1])
    return target, drafter


# -- counting ------------------------------------------------------------------------------------------------------
#: Ops whose output shape depends on the data: on CUDA each waits for the device.
SHAPE_SYNC_OPS = frozenset({"nonzero", "_unique2", "unique_dim", "unique_consecutive", "masked_select"})


def _op_counter_class():
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class OpCounter(TorchDispatchMode):
        """Counts every ``__torch_dispatch__`` call on this thread, with its host-clock time, and the host syncs
        among them (``.item()``, device→host copies, data-dependent shapes)."""

        def __init__(self) -> None:
            super().__init__()
            self.times = array("d")  # sorted: appended in call order on one thread
            self.names: Counter[str] = Counter()
            self.syncs: dict[str, list[float]] = {"item": [], "d2h_copy": [], "data_dependent_shape": []}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            now = time.perf_counter()
            self.times.append(now)
            name = func._overloadpacket.__name__
            self.names[name] += 1
            if name == "_local_scalar_dense":
                self.syncs["item"].append(now)
            elif name in SHAPE_SYNC_OPS:
                self.syncs["data_dependent_shape"].append(now)
            elif name in ("_to_copy", "copy_") and _device_to_host(name, args, kwargs or {}):
                self.syncs["d2h_copy"].append(now)
            return func(*args, **(kwargs or {}))

    def _device_to_host(name, args, kwargs) -> bool:
        if name == "copy_":
            dst, src = args[0], args[1]
            return isinstance(src, torch.Tensor) and src.device.type != "cpu" and dst.device.type == "cpu"
        device = kwargs.get("device")
        return device is not None and torch.device(device).type == "cpu" and args[0].device.type != "cpu"

    return OpCounter


class CudaSyncs:
    """The synchronising calls ``torch.cuda.set_sync_debug_mode("warn")`` flags, with their host-clock time."""

    def __init__(self, enabled: bool) -> None:
        self.enabled, self.times = enabled, []

    @contextlib.contextmanager
    def watch(self):
        if not self.enabled:
            yield self
            return
        import torch

        with warnings.catch_warnings():
            warnings.simplefilter("always")
            shown = warnings.showwarning

            def record(message, category, *rest, **kw):
                if "synchroniz" in str(message):
                    self.times.append(time.perf_counter())
                else:
                    shown(message, category, *rest, **kw)

            warnings.showwarning = record
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield self
            finally:
                torch.cuda.set_sync_debug_mode("default")
                warnings.showwarning = shown


@contextlib.contextmanager
def counting_dequantise():
    """Counts calls to ``checkpoints.mxfp4.dequantize`` wherever a pd_dflash module holds it (restored after)."""
    from pd_dflash.engine.reference.checkpoints import mxfp4

    original, calls = mxfp4.dequantize, []

    def counted(*args, **kwargs):
        calls.append(time.perf_counter())
        return original(*args, **kwargs)

    holders = [
        m
        for name, m in list(sys.modules.items())
        if name.startswith("pd_dflash") and m is not None and getattr(m, "dequantize", None) is original
    ]
    for m in holders:
        m.dequantize = counted
    try:
        yield calls
    finally:
        for m in holders:
            m.dequantize = original


@dataclass
class Capture:
    """What one measured run saw: wall seconds, and in a counting run the ops and syncs with their times."""

    seconds: float = 0.0
    rounds: list = field(default_factory=list)
    #: The timed loop's verify access trace, as the cell's runtime recorded it (``OffloadRuntime.trace``).
    trace: list = field(default_factory=list)
    ops: Any = None  # OpCounter
    cuda_syncs: list[float] = field(default_factory=list)
    dequantise: list[float] | None = None
    busy_fraction: float | None = None


@contextlib.contextmanager
def measured(device, *, count: bool, profile: bool = False, dequantise: bool = False):
    """One measured stretch: device synchronised at both ends; counting or profiling attached on request."""
    import torch

    cap = Capture()
    cuda = device.type == "cuda"
    with contextlib.ExitStack() as stack:
        if count:
            cap.ops = stack.enter_context(_op_counter_class()())
            syncs = stack.enter_context(CudaSyncs(cuda).watch())
            cap.cuda_syncs = syncs.times
        if dequantise:
            cap.dequantise = stack.enter_context(counting_dequantise())
        prof = None
        if profile:
            from torch.profiler import ProfilerActivity
            from torch.profiler import profile as torch_profile

            prof = stack.enter_context(
                torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            )
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        yield cap
        if cuda:
            torch.cuda.synchronize(device)
        cap.seconds = time.perf_counter() - start
    if prof is not None:
        try:
            cap.busy_fraction = _busy_fraction(prof, cap.seconds)
        except (
            Exception
        ) as exc:  # the profiler's event API moves between torch versions: absent, not invented
            print(f"warning: GPU busy fraction not measured: {exc!r}", file=sys.stderr)


def _busy_fraction(prof, seconds: float) -> float | None:
    """The union of the profiled CUDA kernel and copy intervals ÷ wall time (None when the profiler saw none)."""
    from torch.autograd import DeviceType

    spans = sorted(
        (e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == DeviceType.CUDA
    )
    busy_us, end = 0.0, float("-inf")
    for s, e in spans:
        if e > end:
            busy_us += e - max(s, end)
            end = e
    return min(1.0, busy_us * 1e-6 / seconds) if busy_us > 0 and seconds > 0 else None


def _in(times: list[float], start: float, end: float) -> int:
    return bisect.bisect_right(times, end) - bisect.bisect_left(times, start)


# -- transformers ------------------------------------------------------------------------------------------------
def transformers_rows(directory: Path, device, args, prompt: list[int]) -> list[dict[str, Any]]:
    """transformers' resident ``generate`` and one forward of the generated tokens, eager and grouped_mm."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, Mxfp4Config

    config = AutoConfig.from_pretrained(str(directory), local_files_only=True)
    kwargs = {"quantization_config": Mxfp4Config(dequantize=True)} if config.model_type == "gpt_oss" else {}
    model = AutoModelForCausalLM.from_pretrained(
        str(directory), local_files_only=True, dtype=torch.bfloat16, **kwargs
    )
    model = model.eval().to(device)
    ids = torch.tensor([prompt], device=device)
    rows = []
    for impl in ("eager", "grouped_mm"):
        model.set_experts_implementation(impl)
        rows.append(_hf_generate(model, ids, device, args, impl))
        rows.append(_hf_forward(model, ids, device, args, impl, rows[-1].pop("_new")))
    del model
    return rows


def _hf_generate(model, ids, device, args, impl: str) -> dict[str, Any]:
    import torch

    n = args.new_tokens

    def run():
        with torch.no_grad():
            return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)

    out = run()  # warm-up
    times = []
    for _ in range(args.repeats):
        with measured(device, count=False) as cap:
            run()
        times.append(cap.seconds)
    with measured(device, count=True) as counted:
        run()
    row = {"path": f"transformers {impl} generate", "kind": "transformers", "concurrency": 1}
    row.update(_hf_figures(counted, statistics.median(times), per=n, unit="token"))
    row["tokens_per_second"] = n / statistics.median(times)
    row["generated_tokens"] = n
    if args.profile:
        with measured(device, count=False, profile=True) as prof:
            run()
        row["gpu_busy_fraction"] = prof.busy_fraction
    row["_new"] = out[0, ids.shape[1] :].tolist()
    return row


def _hf_forward(model, ids, device, args, impl: str, new: list[int]) -> dict[str, Any]:
    """One forward of the ``len(new)`` generated tokens after the prompt's prefill (fresh cache each time)."""
    import torch
    from transformers import DynamicCache

    block = torch.tensor([new[: args.block_size]], device=device)

    def prefill():
        cache = DynamicCache(config=model.config)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            model(input_ids=ids, past_key_values=cache, use_cache=True)
        return cache

    def forward(cache):
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # past_key_values: the name every 5.x accepts
            model(input_ids=block, past_key_values=cache, use_cache=True)
        if cache.get_seq_length() != ids.shape[1] + block.shape[1]:
            raise RuntimeError(
                "transformers' forward did not extend the KV cache: not a verify-shaped forward"
            )

    forward(prefill())  # warm-up
    times = []
    for _ in range(max(3, args.repeats)):
        cache = prefill()
        with measured(device, count=False) as cap:
            forward(cache)
        times.append(cap.seconds)
    cache = prefill()
    with measured(device, count=True) as counted:
        forward(cache)
    row = {
        "path": f"transformers {impl} forward of {block.shape[1]} tokens",
        "kind": "transformers",
        "concurrency": 1,
        "forward_tokens": int(block.shape[1]),
    }
    row.update(_hf_figures(counted, statistics.median(times), per=1, unit="forward"))
    if args.profile:
        cache = prefill()
        with measured(device, count=False, profile=True) as prof:
            forward(cache)
        row["gpu_busy_fraction"] = prof.busy_fraction
    return row


def _hf_figures(counted: Capture, seconds: float, *, per: int, unit: str) -> dict[str, Any]:
    ops = counted.ops
    out = {
        f"ms_per_{unit}": seconds * 1e3 / per,
        f"ops_per_{unit}": len(ops.times) / per,
        f"host_syncs_per_{unit}": _sync_total(ops) / per,
        "host_syncs_by_kind": {k: len(v) for k, v in ops.syncs.items()},
        "grouped_mm_ops": ops.names.get("_grouped_mm", 0),
        "top_ops": dict(ops.names.most_common(16)),
    }
    if _DEVICE is not None and _DEVICE.type == "cuda":
        out[f"cuda_sync_calls_per_{unit}"] = len(counted.cuda_syncs) / per
    return out


def _sync_total(ops) -> int:
    return sum(len(v) for v in ops.syncs.values())


_DEVICE = None  # set by main: the device the run measures


# -- the reference engine ----------------------------------------------------------------------------------------
def engine_spec(
    name: str, target: Path, drafter: Path, args, baselines: list[str], concurrency: int, link_gbps=None
):
    from pd_dflash.spec import parse_spec

    options: dict[str, Any] = {}
    if args.device == "cpu":
        options["emulated_h2d_gbps"] = link_gbps or args.link_gbps
    hardware: dict[str, Any] = {"device": args.device, "cpus_per_runner": args.threads}
    if args.device == "cuda":
        hardware.update(accelerator_type=None, compute_capability=None)
    return parse_spec(
        {
            "name": "engine-overhead",
            "engine": "reference",
            "models": [
                {
                    "id": f"tiny-geometry-{name}",
                    "path": str(target),
                    "draft": str(drafter),
                    "engine_options": options,
                }
            ],
            "baselines": baselines,
            "block_sizes": [args.block_size],
            "concurrency": [concurrency],
            "repeats": 1,
            "workload": {
                "requests": concurrency,
                "warmup_rounds": 1,
                "max_new_tokens": args.new_tokens,
                "prompt_tokens": args.prompt_tokens,
                "seed": 1408,
            },
            "memory": {"expert_cache_fraction": args.cache_fraction},
            "hardware": hardware,
        }
    )


@contextlib.contextmanager
def timed_loop(engine, device, **how):
    """Measure only the cell's timed loop: ``ReferenceEngine._timed`` wrapped for this instance."""
    original = getattr(engine, "_timed", None)
    if original is None:
        raise SystemExit(
            "benchmarks/engine_overhead.py: ReferenceEngine has no _timed(cell, setup) any more; "
            "update timed_loop() to the engine's timed-loop seam"
        )
    box: dict[str, Capture] = {}

    def timed(cell, setup):
        with measured(device, **how) as cap:
            rounds, seconds = original(cell, setup)
        cap.rounds = rounds
        cap.trace = setup.runtime.trace
        box["capture"] = cap
        return rounds, seconds

    engine._timed = timed
    try:
        yield box
    finally:
        del engine._timed


@contextlib.contextmanager
def warm_up_span(engine):
    """The (start, end) host-clock span of the cell's warm-up rounds (``ReferenceEngine._warm_up`` wrapped on
    the instance), filled in when it has run; empty when the engine has no such seam."""
    original, span = getattr(engine, "_warm_up", None), []
    if original is None:
        yield span
        return

    def warm_up(cell, setup):
        span.append(time.perf_counter())
        try:
            return original(cell, setup)
        finally:
            span.append(time.perf_counter())

    engine._warm_up = warm_up
    try:
        yield span
    finally:
        del engine._warm_up


def engine_row(engine, cell, device, args, *, mxfp4: bool) -> dict[str, Any]:
    """One cell: a timing run, a counting run (ops, syncs, dequantisations), and on CUDA a profiled run."""
    row: dict[str, Any] = {"path": cell.baseline, "kind": "engine", "concurrency": cell.concurrency}
    with (
        measured(device, count=False) as whole,
        timed_loop(engine, device, count=False) as box,
        warm_up_span(engine) as warm,
    ):
        result = engine.run_cell(cell)
    if result.status.value != "OK":
        row.update(status=result.status.value, reason=result.reason)
        return row
    timing = box["capture"]
    row.update(_timing_figures(result, timing))
    row["cell_ms_per_token"] = whole.seconds * 1e3 / row["generated_tokens"]
    if warm:
        row["warm_up_ms"] = (warm[1] - warm[0]) * 1e3
        rest = whole.seconds - (warm[1] - warm[0])
        row["cell_ms_per_token_excl_warm_up"] = rest * 1e3 / row["generated_tokens"]
    if cell.baseline == "OURS":
        predicted = [sum(len(p) for _layer, _needed, p in rnd) for rnd in timing.trace]
        if predicted:
            row["predicted_experts_per_round_median"] = statistics.median(predicted)
    # The whole cell (setup, warm-up, the timed loop, the row) counted by an outer counter; the inner one sees
    # the timed loop only (each op reaches both: a mode re-dispatches to the one below it).
    with (
        measured(device, count=True) as cell_cap,
        timed_loop(engine, device, count=True, dequantise=mxfp4) as box,
        warm_up_span(engine) as warm,
    ):
        counted_result = engine.run_cell(cell)
    moe_layers = int(engine.describe()["moe_layers"])
    row.update(_count_figures(box["capture"], counted_result, moe_layers=moe_layers))
    generated = counted_result.generated_tokens or 1
    row.update(_cell_figures(cell_cap, box["capture"], row["ops_total"], generated))
    if warm:
        row["cell_ops_warm_up"] = _in(cell_cap.ops.times, *warm)
        row["cell_ops_per_token_excl_warm_up"] = (row["cell_ops_total"] - row["cell_ops_warm_up"]) / generated
    if row.get("output_digest") != counted_result.engine.get("output_digest"):
        row["warnings"] = ["the counting run generated different tokens than the timing run"]
    if args.profile:
        with timed_loop(engine, device, count=False, profile=True) as box:
            engine.run_cell(cell)
        row["gpu_busy_fraction"] = box["capture"].busy_fraction
    return row


def _cell_figures(cell: Capture, timed: Capture, timed_ops: int, generated: int) -> dict[str, Any]:
    """Ops of the whole ``run_cell`` per generated token, and where those outside the timed loop fall: before
    it (setup, the warm-up rounds) and after it (the row's assembly, closing)."""
    times, inner = cell.ops.times, timed.ops.times
    before = bisect.bisect_left(times, inner[0]) if len(inner) else None
    return {
        "cell_ops_total": len(times),
        "cell_ops_per_token": len(times) / generated,
        "cell_host_syncs_per_token": _sync_total(cell.ops) / generated,
        "cell_ops_before_timed_loop": before,
        "cell_ops_outside_timed_loop": len(times) - timed_ops,
        "cell_top_ops": dict(cell.ops.names.most_common(16)),
    }


def _verify_rounds(rounds) -> list:
    return [r for r in rounds if not any(r.prefill)]


def _timing_figures(result, cap: Capture) -> dict[str, Any]:
    generated = result.generated_tokens or sum(sum(r.committed) for r in cap.rounds)
    verify = _verify_rounds(cap.rounds)
    out = {
        "status": "OK",
        "generated_tokens": generated,
        "rounds": len(cap.rounds),
        "verify_rounds": len(verify),
        "ms_per_token": cap.seconds * 1e3 / generated,
        "tokens_per_second": result.output_tokens_per_second,
        "acceptance_length_a": result.acceptance_length_a,
        "expert_cache_hit_rate": result.expert_cache_hit_rate,
        "output_digest": result.engine.get("output_digest"),
    }
    prefills = [r for r in cap.rounds if any(r.prefill)]
    out["prefill_rounds_ms"] = sum(r.seconds for r in prefills) * 1e3
    out["outside_rounds_ms"] = (cap.seconds - sum(r.seconds for r in cap.rounds)) * 1e3
    if verify:
        out["ms_per_round"] = statistics.mean(r.seconds for r in verify) * 1e3
        out["ms_per_verify_forward"] = statistics.mean(r.forward_seconds for r in verify) * 1e3
        out["draft_ms_per_round"] = statistics.mean(r.draft_seconds for r in verify) * 1e3
        out["router_ms_per_round"] = statistics.mean(r.router_seconds for r in verify) * 1e3
    if "host_syncs" in result.engine:
        out["engine_host_syncs"] = result.engine["host_syncs"]
    return out


def _window(r, kind: str) -> tuple[float, float] | None:
    return next(((s, e) for k, s, e in r.windows if k == kind), None)


def _count_figures(cap: Capture, result, *, moe_layers: int) -> dict[str, Any]:
    """Ops and syncs per generated token (everything the timed loop dispatched) and per verify forward (the
    ``verify`` window of the rounds without a prefill)."""
    ops, generated = cap.ops, result.generated_tokens or 1
    syncs = sorted(t for v in ops.syncs.values() for t in v)
    verify = _verify_rounds(cap.rounds)
    out: dict[str, Any] = {
        "ops_total": len(ops.times),
        "ops_per_token": len(ops.times) / generated,
        "host_syncs_per_token": len(syncs) / generated,
        "host_syncs_by_kind": {k: len(v) for k, v in ops.syncs.items()},
        "grouped_mm_ops": ops.names.get("_grouped_mm", 0),
        "top_ops": dict(ops.names.most_common(16)),
    }
    if verify:
        windows = [w for w in (_window(r, "verify") for r in verify) if w]
        per_forward = [_in(ops.times, s, e) for s, e in windows]
        out["ops_per_verify_forward"] = statistics.mean(per_forward)
        out["ops_per_round"] = statistics.mean(_in(ops.times, r.start, r.start + r.seconds) for r in verify)
        drafts = [w for w in (_window(r, "draft") for r in verify) if w]
        if drafts:
            out["draft_ops_per_round"] = statistics.mean(_in(ops.times, s, e) for s, e in drafts)
        forward_syncs = statistics.mean(_in(syncs, s, e) for s, e in windows)
        out["host_syncs_per_verify_forward"] = forward_syncs
        out["host_syncs_per_moe_layer_per_verify_forward"] = forward_syncs / moe_layers
        if _DEVICE is not None and _DEVICE.type == "cuda":
            out["cuda_sync_calls_per_token"] = len(cap.cuda_syncs) / generated
            cuda = sorted(cap.cuda_syncs)
            out["cuda_sync_calls_per_verify_forward"] = statistics.mean(_in(cuda, s, e) for s, e in windows)
        if cap.dequantise is not None:
            out["dequantise_calls_timed"] = len(cap.dequantise)
            calls = sorted(cap.dequantise)
            out["dequantise_calls_per_verify_forward"] = statistics.mean(_in(calls, s, e) for s, e in windows)
    return out


# -- BM2 -----------------------------------------------------------------------------------------------------------
def nearest_rank(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


#: BM2's modes: each expert through ``ExpertCache.prefetch`` on its own, and all of them through ONE
#: ``ExpertCache.prefetch_many`` (route-ahead's and the AR prefetcher's issue: one link batch per layer, i.e. one
#: copy dispatch, one landing call, one event pair).
BM2_MODES = ("python-per-expert", "batched")


def bm2(engine, device, args, window_seconds: float | None) -> dict[str, Any]:
    """Saturated prefetch issuance: every expert of every MoE layer through ``ExpertCache.prefetch`` on a
    fresh cache that holds them all (its construction is not timed), the engine's link, in layer order; per
    mode, the modes interleaved iteration by iteration (the same machine load on both). Timed until the last
    call returns (the issue, not the landing: on CUDA the copies run on after it)."""
    from pd_dflash.engine.reference.offload.cache import ExpertCache

    store = engine.store
    keys = [(layer, e) for layer in store.layer_ids for e in range(store.num_experts)]
    samples: dict[str, list[float]] = {m: [] for m in BM2_MODES}
    landing: dict[str, list[float]] = {m: [] for m in BM2_MODES}
    dropped = dict.fromkeys(BM2_MODES, 0)
    for i in range(args.bm2_warmup + args.bm2_iterations):
        for mode in BM2_MODES:
            cache = ExpertCache(
                store, store.total_bytes, device, engine.compute_dtype, link=_link(device, args)
            )
            spent = _time_landings(cache.slots)
            start = time.perf_counter_ns()
            if mode == "batched":
                dropped[mode] += len(keys) - cache.prefetch_many(keys)[0]
            else:
                for key in keys:
                    if not cache.prefetch(key):
                        dropped[mode] += 1
            elapsed = time.perf_counter_ns() - start
            cache.close()
            if i >= args.bm2_warmup:
                samples[mode].append(elapsed / 1e3)
                landing[mode].append(spent[0] / 1e3)
    out: dict[str, Any] = {
        "benchmark": "BM2",
        "mode": "python-per-expert (ExpertCache.prefetch per expert)",
        "experts_issued": len(keys),
        "dropped": dropped["python-per-expert"],
        "iterations": len(samples["python-per-expert"]),
        **_quantiles(samples["python-per-expert"]),
        "modes": {},
    }
    for mode in BM2_MODES:
        out["modes"][mode] = {"dropped": dropped[mode], **_quantiles(samples[mode])}
        out["modes"][mode]["issue_p50_us_per_expert"] = out["modes"][mode]["issue_p50_us"] / len(keys)
        out["modes"][mode]["landing_p50_us"] = statistics.median(landing[mode])
        if device.type == "cpu" and any(landing[mode]):
            # The emulated link lands (dequantises) inside the issue call; on CUDA the decoding runs on the
            # copy stream after the issue returns. The issue path without it, per iteration:
            excl = [a - b for a, b in zip(samples[mode], landing[mode], strict=True)]
            out["modes"][mode]["issue_excl_landing_p50_us"] = nearest_rank(excl, 0.5)
    out["landing"] = (
        "none: the slots hold the compute format"
        if cache.slots.direct
        else "dequantised at landing: inside the issue call on the emulated link (landing_p50_us); "
        "issue_excl_landing_p50_us is the issue without it"
        if device.type == "cpu"
        else "dequantised on the copy stream; landing_p50_us is its host dispatch inside the issue"
    )
    out["issue_p50_us_per_expert"] = out["issue_p50_us"] / len(keys)
    batched = out["modes"]["batched"]
    out["batched_p50_over_per_expert_p50"] = batched["issue_p50_us"] / out["issue_p50_us"]
    per_excl = out["modes"]["python-per-expert"].get("issue_excl_landing_p50_us")
    if per_excl and batched.get("issue_excl_landing_p50_us") is not None:
        out["batched_over_per_expert_excl_landing_p50"] = batched["issue_excl_landing_p50_us"] / per_excl
    if window_seconds is not None and window_seconds > 0:
        out["window_us"] = window_seconds * 1e6
        out["candidate_required"] = out["issue_p50_us"] > out["window_us"]
        # Upstream's rule: a batched path ships when one is required and its measured median fits the window.
        out["ship_batched"] = out["candidate_required"] and batched["issue_p50_us"] <= out["window_us"]
        if "batched_over_per_expert_excl_landing_p50" in out:
            excl = out["modes"]["python-per-expert"]["issue_excl_landing_p50_us"]
            out["ship_batched_excl_landing"] = (
                excl > out["window_us"] and batched["issue_excl_landing_p50_us"] <= out["window_us"]
            )
    return out


def _time_landings(slots) -> list[int]:
    """Nanoseconds the pool spends landing (dequantising) slots, summed into the returned box: its two landing
    steps wrapped on this instance (the outer call only, when one calls the other)."""
    spent, depth = [0], [0]
    for name in ("_dequantize_slots", "_dequantize_into"):
        original = getattr(slots, name)

        def wrapped(*a, _original=original, **kw):
            if depth[0]:
                return _original(*a, **kw)
            depth[0] += 1
            t0 = time.perf_counter_ns()
            try:
                return _original(*a, **kw)
            finally:
                spent[0] += time.perf_counter_ns() - t0
                depth[0] -= 1

        setattr(slots, name, wrapped)
    return spent


def _quantiles(samples: list[float]) -> dict[str, float]:
    return {
        **{f"issue_{n}_us": nearest_rank(samples, q) for n, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))},
        "issue_min_us": min(samples),
        "issue_max_us": max(samples),
    }


def _link(device, args):
    if device.type == "cuda":
        from pd_dflash.engine.reference.offload.cuda_link import CudaLink

        return CudaLink(device)
    from pd_dflash.engine.reference.offload.link import HostLink

    return HostLink(args.link_gbps, 0.0)


# -- BM3 -----------------------------------------------------------------------------------------------------------
#: Upstream's ``bench_prefetch_priority`` arms: the link band route-ahead's router-pass predictions go in
#: (``offload/link.py``). Background traffic is the same in every arm: route-ahead's history issued at the end of a
#: verify (band 2), which a route-ahead band of 1 overtakes, band 2 queues behind, band 0 bypasses.
BM3_ARMS = {"on-demand": 0, "route-ahead": 1, "background": 2}


@contextlib.contextmanager
def route_ahead_band(engine, band: int):
    """Every cell the engine runs meanwhile gives route-ahead's predictions ``band`` from its warm-up on
    (``ReferenceEngine._warm_up`` wrapped for this instance, the benchmark's seam like ``timed_loop``)."""
    original = getattr(engine, "_warm_up", None)
    if original is None:
        raise SystemExit(
            "benchmarks/engine_overhead.py: ReferenceEngine has no _warm_up(cell, setup) any more"
        )

    def warm_up(cell, setup):
        prefetcher = setup.runtime.prefetcher
        if prefetcher is None or not hasattr(prefetcher, "band"):
            raise SystemExit("BM3: the cell has no route-ahead prefetcher with a link band")
        prefetcher.band = band
        return original(cell, setup)

    engine._warm_up = warm_up
    try:
        yield
    finally:
        del engine._warm_up


def bm3(geo: Geometry, target: Path, drafter: Path, device, args) -> dict[str, Any]:
    """OURS at c = ``--bm3-concurrency`` on a busy link, once per arm and repetition (arms interleaved so each
    sees the same machine load); each run is a fresh cell: identical seeded requests, a fresh cache, the spec's
    warm-up. Median exposed fetch seconds and tokens/s per arm, and upstream's decision."""
    from pd_dflash.engine.interface import EngineContext
    from pd_dflash.engine.reference.engine import ReferenceEngine
    from pd_dflash.spec import expand

    gbps = args.bm3_link_gbps if args.device == "cpu" else None
    spec = engine_spec(geo.name, target, drafter, args, ["OURS"], args.bm3_concurrency, link_gbps=gbps)
    engine = ReferenceEngine(
        EngineContext.for_model(spec, device="cuda:0" if args.device == "cuda" else "cpu")
    )
    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in BM3_ARMS}
    try:
        (cell,) = list(expand(spec))
        for _ in range(args.bm3_repeats):
            for arm, band in BM3_ARMS.items():
                with route_ahead_band(engine, band):
                    result = engine.run_cell(cell)
                if result.status.value != "OK":
                    return {"benchmark": "BM3", "status": result.status.value, "reason": result.reason}
                terms = result.cost_terms
                runs[arm].append(
                    {
                        "exposed_fetch_seconds": terms.exposed_fetch_seconds if terms else None,
                        "tokens_per_second": result.output_tokens_per_second,
                        "output_digest": result.engine.get("output_digest"),
                    }
                )
    finally:
        engine.close()
    out: dict[str, Any] = {
        "benchmark": "BM3",
        "status": "OK",
        "concurrency": args.bm3_concurrency,
        "requests": args.bm3_concurrency,
        "repeats": args.bm3_repeats,
        "emulated_link_gbps": gbps,
        "arms": {},
    }
    for arm, band in BM3_ARMS.items():
        exposed = [r["exposed_fetch_seconds"] for r in runs[arm]]
        tps = [r["tokens_per_second"] for r in runs[arm]]
        out["arms"][arm] = {
            "route_ahead_band": band,
            "exposed_fetch_seconds_median": statistics.median(exposed) if None not in exposed else None,
            "tokens_per_second_median": statistics.median(tps) if None not in tps else None,
            "runs": runs[arm],
        }
    digests = {r["output_digest"] for arm in runs.values() for r in arm}
    out["outputs_identical"] = len(digests) == 1
    arms = out["arms"]
    od, ra, bg = (arms[a]["exposed_fetch_seconds_median"] for a in BM3_ARMS)
    ra_tps, bg_tps = (
        arms["route-ahead"]["tokens_per_second_median"],
        arms["background"]["tokens_per_second_median"],
    )
    if None not in (od, ra, bg, ra_tps, bg_tps):
        # Upstream's rule: route-ahead's band beats background's, and on-demand is no worse than either.
        out["ship_priority_band"] = ra < bg and ra_tps >= bg_tps and od <= min(ra, bg)
    return out


# -- one geometry ----------------------------------------------------------------------------------------------------
def run_geometry(geo: Geometry, args, report: Report) -> None:
    import torch

    from pd_dflash.engine.interface import EngineContext
    from pd_dflash.engine.reference.engine import ReferenceEngine
    from pd_dflash.spec import expand

    layers = min(args.layers or geo.layers, geo.layers)
    entry = report.geometry(geo, layers, args)
    start = time.perf_counter()
    target, drafter = checkpoint(geo, layers, args.block_size, args.cache_dir)
    entry["checkpoint"] = {
        "target": str(target),
        "drafter": str(drafter),
        "seconds": time.perf_counter() - start,
    }
    report.write()
    device = torch.device("cuda:0" if args.device == "cuda" else "cpu")
    gen = torch.Generator().manual_seed(1408)
    prompt = torch.randint(16, 120, (args.prompt_tokens,), generator=gen).tolist()
    for row in transformers_rows(target, device, args, prompt):
        report.add_row(geo, row)
    ours_window = None
    for conc, baselines in _plan(args):
        spec = engine_spec(geo.name, target, drafter, args, baselines, conc)
        t0 = time.perf_counter()
        engine = ReferenceEngine(
            EngineContext.for_model(spec, device="cuda:0" if args.device == "cuda" else "cpu")
        )
        entry.setdefault("engine_load_seconds", {})[str(conc)] = time.perf_counter() - t0
        try:
            for cell in expand(spec):
                row = engine_row(engine, cell, device, args, mxfp4=geo.storage == "mxfp4")
                report.add_row(geo, row)
                if cell.baseline == "OURS" and conc == 1 and row.get("status") == "OK":
                    ours_window = (row["draft_ms_per_round"] + row["router_ms_per_round"]) / 1e3
            if conc == 1:
                entry["bm2"] = bm2(engine, device, args, ours_window)
                if ours_window is None:
                    report.warn(
                        f"{geo.name}: no OURS c = 1 row, so BM2 has no window (candidate_required absent)"
                    )
                report.write()
        finally:
            engine.close()
    if args.bm3:
        entry["bm3"] = bm3(geo, target, drafter, device, args)
        report.write()
    report.finish_geometry(geo)


def _plan(args) -> list[tuple[int, list[str]]]:
    """(concurrency, baselines): every configuration at c = 1, B0 and B3 at the other levels."""
    plan = [(1, list(args.baselines))]
    plan += [(c, [b for b in ("B0", "B3") if b in args.baselines]) for c in args.concurrency if c != 1]
    return [(c, b) for c, b in plan if b]


# -- the report ------------------------------------------------------------------------------------------------------
class Report:
    """The JSON document, rewritten atomically after every row."""

    def __init__(self, path: Path | None, args, command: str) -> None:
        import torch
        import transformers

        self.path = path
        self.doc: dict[str, Any] = {
            "benchmark": BENCHMARK,
            "schema_version": SCHEMA_VERSION,
            "status": "running",
            "command": command,
            "device": args.device,
            "device_name": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "threads": torch.get_num_threads(),
            "settings": {
                "prompt_tokens": args.prompt_tokens,
                "new_tokens": args.new_tokens,
                "block_size": args.block_size,
                "expert_cache_fraction": args.cache_fraction,
                "emulated_link_gbps": args.link_gbps if args.device == "cpu" else None,
                "concurrency": [1, *[c for c in args.concurrency if c != 1]],
                "repeats": args.repeats,
                "quick": args.quick,
            },
            "load_average_at_start": list(os.getloadavg()),
            "geometries": {},
            "warnings": [],
        }

    def geometry(self, geo: Geometry, layers: int, args) -> dict[str, Any]:
        entry = {
            "real_model": geo.real_model,
            "layers": layers,
            "real_layers": geo.layers,
            "extrapolation_factor": geo.layers / layers,
            "experts": geo.experts,
            "top_k": geo.top_k,
            "storage": geo.storage,
            "hidden_size": 64,
            "rows": [],
            "ratios": {},
            "status": "running",
        }
        self.doc["geometries"][geo.name] = entry
        self.write()
        return entry

    def add_row(self, geo: Geometry, row: dict[str, Any]) -> None:
        entry = self.doc["geometries"][geo.name]
        factor = entry["extrapolation_factor"]
        if factor != 1 and row.get("status", "OK") == "OK":  # linear in the depth: [derived], not measured
            for key in ("ms_per_token", "ops_per_token", "ms_per_forward", "ops_per_forward", "ms_per_round"):
                if row.get(key) is not None:
                    row[f"{key}_at_real_depth"] = row[key] * factor
            if row.get("tokens_per_second"):
                row["tokens_per_second_at_real_depth"] = row["tokens_per_second"] / factor
        entry["rows"].append(row)
        entry["ratios"] = ratios(entry)
        self.write()
        print(_row_line(geo.name, row), flush=True)

    def warn(self, message: str) -> None:
        self.doc["warnings"].append(message)
        print(f"warning: {message}", file=sys.stderr, flush=True)

    def finish_geometry(self, geo: Geometry) -> None:
        self.doc["geometries"][geo.name]["status"] = "complete"
        self.write()

    def finish(self) -> None:
        self.doc["status"] = "complete"
        self.doc["load_average_at_end"] = list(os.getloadavg())
        self.write()

    def write(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.doc, indent=2, default=str) + "\n")
        os.replace(tmp, self.path)


def _find(rows: list[dict], path: str, concurrency: int = 1) -> dict | None:
    for r in rows:
        if r["path"] == path and r["concurrency"] == concurrency and r.get("status", "OK") == "OK":
            return r
    return None


def _forward_path(rows: list[dict], impl: str) -> dict | None:
    return next((r for r in rows if r["path"].startswith(f"transformers {impl} forward")), None)


def ratios(entry: dict[str, Any]) -> dict[str, Any]:
    """The issue's ratios against transformers (those whose two sides are measured), and ops per token vs c."""
    rows = entry["rows"]
    grouped, eager = (
        _find(rows, "transformers grouped_mm generate"),
        _find(rows, "transformers eager generate"),
    )
    grouped_fwd, eager_fwd = _forward_path(rows, "grouped_mm"), _forward_path(rows, "eager")
    b0, b3 = _find(rows, "B0"), _find(rows, "B3")
    out: dict[str, Any] = {}

    def put(name, num, num_key, den, den_key):
        if num and den and num.get(num_key) is not None and den.get(den_key):
            out[name] = num[num_key] / den[den_key]

    put("b0_ops_per_token_over_grouped_mm_generate", b0, "ops_per_token", grouped, "ops_per_token")
    # The whole cell (setup, warm-up, timed loop, the row) against generate's whole call (issue 28 item 4).
    put("b0_cell_ops_per_token_over_grouped_mm_generate", b0, "cell_ops_per_token", grouped, "ops_per_token")
    put("b0_cell_ms_per_token_over_grouped_mm_generate", b0, "cell_ms_per_token", grouped, "ms_per_token")
    put("b0_ms_per_token_over_grouped_mm_generate", b0, "ms_per_token", grouped, "ms_per_token")
    # The cell without its warm-up rounds (generate's warm-up call is not counted either): setup, rounds, row.
    put(
        "b0_cell_excl_warm_up_ops_per_token_over_grouped_mm_generate",
        b0,
        "cell_ops_per_token_excl_warm_up",
        grouped,
        "ops_per_token",
    )
    put(
        "b0_cell_excl_warm_up_ms_per_token_over_grouped_mm_generate",
        b0,
        "cell_ms_per_token_excl_warm_up",
        grouped,
        "ms_per_token",
    )
    put(
        "b3_ops_per_verify_forward_over_grouped_mm_forward",
        b3,
        "ops_per_verify_forward",
        grouped_fwd,
        "ops_per_forward",
    )
    put("b0_ms_per_token_over_eager_generate", b0, "ms_per_token", eager, "ms_per_token")
    put("b3_ms_per_round_over_eager_forward", b3, "ms_per_round", eager_fwd, "ms_per_forward")
    for b in ("B0", "B1", "B3", "OURS"):
        put(
            f"{b.lower()}_tokens_per_second_over_grouped_mm_generate",
            _find(rows, b),
            "tokens_per_second",
            grouped,
            "tokens_per_second",
        )
    for b in ("B0", "B3"):
        by_c = {r["concurrency"]: r["ops_per_token"] for r in rows if r["path"] == b and "ops_per_token" in r}
        if by_c:
            out[f"{b.lower()}_ops_per_token_by_concurrency"] = {str(c): by_c[c] for c in sorted(by_c)}
    return out


def _fmt(v: Any, digits: int = 0) -> str:
    if v is None:
        return "—"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, (int, float)):
        return f"{v:,.{digits}f}"
    return str(v)


def _row_line(name: str, row: dict[str, Any]) -> str:
    if row.get("status", "OK") != "OK":
        return f"[{name}] {row['path']} c={row['concurrency']}: {row.get('status')} {row.get('reason')}"
    unit = "forward" if "ops_per_forward" in row else "token"
    return (
        f"[{name}] {row['path']} c={row['concurrency']}: {_fmt(row.get(f'ms_per_{unit}'), 1)} ms/{unit}, "
        f"{_fmt(row.get(f'ops_per_{unit}'))} ops/{unit}, {_fmt(row.get(f'host_syncs_per_{unit}'), 1)} syncs/{unit}"
    )


def render(doc: dict[str, Any]) -> str:
    """The markdown tables of a report (docs/engine-overhead.md)."""
    load = doc.get("load_average_at_start")
    out = [
        f"`{doc['command']}` — {doc['device_name']}, torch {doc['torch']}, transformers {doc['transformers']}, "
        f"{doc['threads']} thread(s)"
        + (f", load average {load[0]:.1f} at the start" if load else "")
        + f"; status: {doc['status']}",
        "",
    ]
    for name, g in doc["geometries"].items():
        out += [
            f"### {name} ({g['real_model']}): {g['layers']} layers × {g['experts']} experts, top-{g['top_k']}, "
            f"{g['storage']} (×{g['extrapolation_factor']:g} to the real depth)",
            "",
            "| path | c | ms / token | ops / token | host syncs / token | ms / verify round | ops / verify forward "
            "| host syncs / verify forward | tokens/s | dequantise calls (timed) |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in g["rows"]:
            out.append(_table_row(r))
        if g["extrapolation_factor"] != 1:
            out += [
                "",
                f"At the real depth ({g['real_layers']} layers; ×{g['extrapolation_factor']:g}, linear in the "
                "layers — derived, not measured):",
                "",
                "| path | c | ms / token | ms / verify round or forward | tokens/s |",
                "|---|---|---|---|---|",
            ]
            for r in g["rows"]:
                if r.get("status", "OK") == "OK":
                    per = r.get("ms_per_forward_at_real_depth", r.get("ms_per_round_at_real_depth"))
                    out.append(
                        f"| {r['path']} | {r['concurrency']} | {_fmt(r.get('ms_per_token_at_real_depth'), 1)} | "
                        f"{_fmt(per, 1)} | {_fmt(r.get('tokens_per_second_at_real_depth'), 1)} |"
                    )
        out += ["", "| ratio | value |", "|---|---|"]
        for k, v in g["ratios"].items():
            if isinstance(v, dict):  # ops per token by concurrency
                shown = ", ".join(f"c={c}: {v[c]:,.0f}" for c in sorted(v, key=int))
            else:
                shown = f"{v:.2f}"
            out.append(f"| {k} | {shown} |")
        if "bm2" in g:
            b = g["bm2"]
            out += [
                "",
                f"BM2 (saturated prefetch issuance, {b['experts_issued']:,} experts, {b['iterations']} iterations): "
                f"p50 {b['issue_p50_us']:,.0f} µs, p90 {b['issue_p90_us']:,.0f} µs, p99 {b['issue_p99_us']:,.0f} µs "
                f"({b['issue_p50_us_per_expert']:.1f} µs per expert); window t_draft + t_router = "
                f"{_fmt(b.get('window_us'))} µs; candidate_required = {_fmt(b.get('candidate_required'))}",
            ]
            for mode, m in b.get("modes", {}).items():
                out.append(
                    f"- {mode}: p50 {m['issue_p50_us']:,.0f} µs, p90 {m['issue_p90_us']:,.0f} µs, "
                    f"p99 {m['issue_p99_us']:,.0f} µs ({m['issue_p50_us_per_expert']:.2f} µs per expert)"
                    + (
                        f"; landing (dequantisation) p50 {m['landing_p50_us']:,.0f} µs, issue without it p50 "
                        f"{m['issue_excl_landing_p50_us']:,.0f} µs"
                        if "issue_excl_landing_p50_us" in m
                        else ""
                    )
                )
            if "batched_p50_over_per_expert_p50" in b:
                out.append(
                    f"- batched p50 / per-expert p50 = {b['batched_p50_over_per_expert_p50']:.3f} (target ≤ 0.2); "
                    f"ship_batched = {_fmt(b.get('ship_batched'))}"
                )
            if "batched_over_per_expert_excl_landing_p50" in b:
                out.append(
                    f"- without the landing: batched / per-expert = "
                    f"{b['batched_over_per_expert_excl_landing_p50']:.3f}; "
                    f"ship_batched_excl_landing = {_fmt(b.get('ship_batched_excl_landing'))} ({b['landing']})"
                )
        if "bm3" in g:
            out += ["", *_bm3_lines(g["bm3"])]
        out.append("")
    if doc["warnings"]:
        out += ["Warnings:", *[f"- {w}" for w in doc["warnings"]], ""]
    return "\n".join(out)


def _bm3_lines(b: dict[str, Any]) -> list[str]:
    if b.get("status") != "OK":
        return [f"BM3: {b.get('status')}: {b.get('reason')}"]
    link = (
        f"link emulated at {b['emulated_link_gbps']:g} GB/s" if b.get("emulated_link_gbps") else "CUDA link"
    )
    lines = [
        f"BM3 (priority band; OURS, c = {b['concurrency']}, {b['repeats']} repetitions per arm, {link}):",
        "",
        "| route-ahead band (arm) | median exposed fetch (ms) | median tokens/s |",
        "|---|---|---|",
    ]
    for arm, a in b["arms"].items():
        exposed = a["exposed_fetch_seconds_median"]
        lines.append(
            f"| {a['route_ahead_band']} ({arm}) | {_fmt(exposed * 1e3 if exposed is not None else None, 1)} | "
            f"{_fmt(a['tokens_per_second_median'], 1)} |"
        )
    lines += [
        "",
        f"ship_priority_band = {_fmt(b.get('ship_priority_band'))}; outputs identical across arms: "
        f"{_fmt(b.get('outputs_identical'))}",
    ]
    return lines


def _table_row(r: dict[str, Any]) -> str:
    if r.get("status", "OK") != "OK":
        return f"| {r['path']} | {r['concurrency']} | {r.get('status')}: {r.get('reason')} |||||||| "
    forward = "ops_per_forward" in r
    cells = [
        r["path"],
        str(r["concurrency"]),
        _fmt(r.get("ms_per_token"), 1),
        _fmt(r.get("ops_per_token")),
        _fmt(r.get("host_syncs_per_token"), 1),
        _fmt(r.get("ms_per_forward") if forward else r.get("ms_per_round"), 1),
        _fmt(r.get("ops_per_forward") if forward else r.get("ops_per_verify_forward")),
        _fmt(r.get("host_syncs_per_forward") if forward else r.get("host_syncs_per_verify_forward"), 1),
        _fmt(r.get("tokens_per_second"), 1),
        _fmt(r.get("dequantise_calls_timed")),
    ]
    return "| " + " | ".join(cells) + " |"


# -- CLI -------------------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--geometry", choices=(*GEOMETRIES, "both"), default="both")
    p.add_argument("--layers", type=_positive, default=None, help="cut the depth (default: the real one)")
    p.add_argument("--json", type=Path, default=None, help="write the report here (after every row)")
    p.add_argument(
        "--render", type=Path, default=None, help="print the markdown of an existing report and exit"
    )
    p.add_argument(
        "--quick", action="store_true", help="CI smoke size: 2 layers, 8-token prompt, 4 new, B = 4"
    )
    p.add_argument("--prompt-tokens", type=_positive, default=32)
    p.add_argument("--new-tokens", type=_positive, default=16)
    p.add_argument("--block-size", type=_positive, default=16)
    p.add_argument("--concurrency", type=_positive, nargs="+", default=[4, 16], help="levels beside c = 1")
    p.add_argument(
        "--baselines", nargs="+", default=["B0", "B1", "B3", "OURS"], choices=("B0", "B1", "B3", "OURS")
    )
    p.add_argument("--cache-fraction", type=float, default=0.25)
    p.add_argument("--link-gbps", type=float, default=1000.0, help="CPU: the emulated link (≈ free)")
    p.add_argument(
        "--repeats", type=_positive, default=1, help="timing runs of each transformers path (median)"
    )
    p.add_argument("--threads", type=_positive, default=1)
    p.add_argument("--bm2-iterations", type=_positive, default=20)
    p.add_argument("--bm2-warmup", type=int, default=2)
    p.add_argument("--no-bm3", dest="bm3", action="store_false", help="skip BM3 (the priority band)")
    p.add_argument("--bm3-repeats", type=_positive, default=3, help="BM3 runs per arm (median)")
    p.add_argument("--bm3-concurrency", type=_positive, default=4, help="BM3: requests served at once")
    p.add_argument(
        "--bm3-link-gbps",
        type=float,
        default=0.02,
        help="BM3 on the CPU: the emulated link (busy, so bands matter)",
    )
    p.add_argument("--no-profile", dest="profile", action="store_false", help="CUDA: skip the profiled run")
    p.add_argument(
        "--cache-dir", default=None, help="where the checkpoints are cached (default: the engine cache)"
    )
    args = p.parse_args(argv)
    if args.quick:
        args.layers = args.layers or 2
        args.prompt_tokens, args.new_tokens, args.block_size = 8, 4, 4
        args.concurrency, args.bm2_iterations, args.bm2_warmup = [2], 3, 1
        args.bm3_repeats, args.bm3_concurrency = 2, 2
    if args.new_tokens < args.block_size:
        p.error(f"--new-tokens ({args.new_tokens}) must be at least --block-size ({args.block_size})")
    if not args.bm3_link_gbps > 0:
        p.error(f"--bm3-link-gbps must be > 0, got {args.bm3_link_gbps}")
    if not 0.0 < args.cache_fraction < 1.0:
        p.error(f"--cache-fraction must be in (0, 1), got {args.cache_fraction}")
    args.profile = args.profile and args.device == "cuda"
    return args


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be ≥ 1, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    global _DEVICE
    args = parse_args(argv)
    if args.render is not None:
        print(render(json.loads(args.render.read_text())))
        return 0
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("engine_overhead.py: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    _DEVICE = torch.device("cuda:0" if args.device == "cuda" else "cpu")
    command = "python benchmarks/engine_overhead.py " + " ".join(sys.argv[1:] if argv is None else argv)
    report = Report(args.json, args, command.strip())
    names = list(GEOMETRIES) if args.geometry == "both" else [args.geometry]
    for name in names:
        run_geometry(GEOMETRIES[name], args, report)
    report.finish()
    print()
    print(render(report.doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
