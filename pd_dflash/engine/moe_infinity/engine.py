"""Adapter from the engine interface to MoE-Infinity (``engine: moe_infinity``), for the real GPU runs.

One runner process holds one MoE-Infinity model (its native engine keeps process-global state that does not
survive a second in-process load, research/upstream-phase-a.md §9.8). Per load: ``MoE(model, {"offload_path",
"device_memory_ratio"})`` at ``memory.device_memory_ratio`` (shared load: B0, B1, B2, OURS) or
``memory.resident_memory_ratio`` (B3's own load), the DFlash speculator from the draft path with route-ahead
statistics on, the probed host→device bandwidth and the device identity.

Per cell: a ContinuousBatchingEngine with ``max_batch_size = c`` serves ``workload.requests`` requests with c
in flight (``serving.drive``). What each configuration switches (never silently the same as another):

- B0: no speculator (autoregressive, batched decode).
- B3: B1's speculative path on the resident load (upstream's B3: DFlash with every expert resident).
- B1: DFlash with route-ahead OFF (the verify-time prefetcher hook returns None, so the expert executor keeps
  its unchanged AR prefetch path) and non-binding verify budgets (every pending verify admitted each step).
- B2: DFlash, route-ahead OFF, token-deficit scheduling (upstream's ``build_b2_serving_config``: token budget
  and cap = B, expert bytes unbounded). Upstream's PR #165 ran B2 with the route-ahead seam active only because
  its build could not switch it off; pd-dflash's B2 keeps the AR prefetcher (docs/metrics.md).
- OURS: DFlash, route-ahead ON, the 2-D (tokens, expert bytes) deficit scheduler with a byte budget.

A configuration the installed build cannot express comes back BLOCKED_UNTIL_2D_SCHEDULER or REFUSED with the
missing piece named (``features.Build``); upstream's refusal rule holds (offloaded cells with no offloaded
expert are refused with the fix), and a B3 that does not fit resident is UNAVAILABLE_CAPACITY.
"""

from __future__ import annotations

import gc
import math
import os
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

from pd_dflash.engine import nvml
from pd_dflash.engine.interface import Engine, EngineContext
from pd_dflash.engine.moe_infinity import metrics as m
from pd_dflash.engine.moe_infinity.features import ROUTE_AHEAD_SEAM, Build, detect
from pd_dflash.engine.moe_infinity.options import MoEInfinityOptions
from pd_dflash.engine.moe_infinity.prompts import build_prompts
from pd_dflash.engine.moe_infinity.serving import drive, record_rounds, track_kv_peak
from pd_dflash.errors import InputError
from pd_dflash.schema import CostTerms, EngineResult, Status
from pd_dflash.spec import Cell
from pd_dflash.upstream import ROUTE_AHEAD_KEYS

#: Upstream's "unbounded" expert-byte budget for B2 (its value was not visible; any bound above M works).
B2_UNBOUNDED_EXPERT_BYTES = 1 << 62
#: Environment the runner applies from ``spec.env`` before MoE-Infinity is imported; recorded as seen.
IMPORT_ENV_KEYS = (
    "HF_HOME",
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "TRANSFORMERS_CACHE",
    "MOE_ENABLE_SM120",
    "MOE_PREFETCH_ISSUE_MODE",
    "CUDA_VISIBLE_DEVICES",
)
_ELEMENT_SIZE = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4, "float8_e4m3fn": 1}

#: What this process loaded ("model (group load)"); a second load is refused (one model per process).
_PROCESS_LOAD: str | None = None


@dataclass(frozen=True)
class CellPlan:
    speculative: bool
    #: True/False: the route-ahead prefetcher hook is bound / switched off; None: not speculative.
    route_ahead: bool | None
    #: The four verify budgets passed to the serving scheduler, or None (scheduler's verify gate off).
    verify_budgets: dict[str, int] | None
    #: "ar_batched", "spec_sessions" (per-round driver) or "spec_whole_request" (one generate per request).
    serving_path: str


class MoEInfinityEngine(Engine):
    """One MoE-Infinity model in this runner process; ``run_cell`` measures one cell through its server."""

    def __init__(self, ctx: EngineContext) -> None:
        super().__init__(ctx)
        self.options = MoEInfinityOptions.model_validate(ctx.model.engine_options)
        self.cuda = ctx.device.startswith("cuda")
        self.ratio = (
            ctx.memory.resident_memory_ratio
            if ctx.load_group == "resident"
            else ctx.memory.device_memory_ratio
        )
        self.moe: Any = None
        self.speculator: Any = None
        self.tokenizer: Any = None
        self.h2d: float | None = None
        self.refusal: str | None = None
        self.num_offloaded = 0
        self.draft_block_size: int | None = None
        self._facts: dict[str, Any] = {
            "name": "moe_infinity",
            "load_group": ctx.load_group,
            "device": ctx.device,
            "device_memory_ratio": self.ratio,
        }
        self._check_device()
        if self.refusal is None:
            self._load()

    # -- load -----------------------------------------------------------------------------------------------
    def _check_device(self) -> None:
        """Exactly one visible CUDA device matching the spec's hardware requirement; probe H2D once."""
        if not self.cuda:
            self._facts["device_check"] = f"device {self.ctx.device}: not a CUDA device, nothing validated"
            return
        import torch

        from pd_dflash.engine.probe import measure_h2d_bytes_per_second

        if not torch.cuda.is_available():
            raise RuntimeError(f"device {self.ctx.device} requested but CUDA is not available in this runner")
        count = torch.cuda.device_count()
        if count != 1:
            raise RuntimeError(
                f"MoE-Infinity runners need exactly one visible CUDA device, found {count}: the runner must see "
                "only the GPU Ray assigned to it (CUDA_VISIBLE_DEVICES=<one id>)"
            )
        hw = self.ctx.hardware
        check = nvml.validate_device(hw.expected_gpu_name, hw.compute_capability)
        name, capability = torch.cuda.get_device_name(0), tuple(torch.cuda.get_device_capability(0))
        problems = [] if check.ok else [check.note]
        if hw.compute_capability and capability != tuple(hw.compute_capability):
            problems.append(
                f"torch reports compute capability {capability}, spec requires {hw.compute_capability}"
            )
        if hw.expected_gpu_name and hw.expected_gpu_name.lower() not in name.lower():
            problems.append(
                f"torch reports {name!r}, spec requires a name containing {hw.expected_gpu_name!r}"
            )
        self._facts.update(
            device_check=check.note, device_identity=check.identity, torch_device=[name, list(capability)]
        )
        if problems:
            self.refusal = (
                "device rejected by the spec's hardware requirement: "
                + "; ".join(dict.fromkeys(problems))
                + " (set hardware.gpu_name / hardware.compute_capability to run on another GPU)"
            )
            return
        self.h2d = measure_h2d_bytes_per_second(self.ctx.device)
        self._facts["h2d_probe_bytes_per_second"] = self.h2d

    def _load(self) -> None:
        global _PROCESS_LOAD
        if _PROCESS_LOAD is not None:
            raise RuntimeError(
                f"MoE-Infinity already loaded {_PROCESS_LOAD} in this process (pid {os.getpid()}); its native "
                "engine keeps process-global state that does not survive a second in-process load, so pd-dflash "
                "runs one MoE-Infinity model per runner process (restart the runner to load another)"
            )
        model = self.ctx.model
        if not model.offload_dir:
            raise InputError(
                "MoE-Infinity needs models[].offload_dir (where it stores offloaded experts)",
                where=f"models[{model.id}].offload_dir",
            )
        _PROCESS_LOAD = f"{model.id} ({self.ctx.load_group} load)"
        imported_before = "moe_infinity" in sys.modules
        self._facts["import_environment"] = {k: os.environ[k] for k in IMPORT_ENV_KEYS if k in os.environ}
        import moe_infinity  # after the runner applied spec.env (HF_HOME, MOE_ENABLE_SM120, offline flags)
        from moe_infinity import MoE

        self.build: Build = detect(moe_infinity)
        self._facts.update(version=self.build.version, fake=self.build.fake, features=self.build.as_dict())
        if imported_before:
            self._facts["import_note"] = "moe_infinity was imported before the engine; spec.env may not apply"
        start = time.perf_counter()
        config = {
            **self.options.moe_config,
            "offload_path": model.offload_dir,
            "device_memory_ratio": self.ratio,
        }
        self.moe = MoE(model.id, config)
        self.num_offloaded = m.offloaded_experts(self.moe.engine)
        self._facts.update(
            num_offloaded_experts=self.num_offloaded, total_expert_bytes=m.total_expert_bytes(self.moe.engine)
        )
        if model.draft:  # every configuration but B0 is speculative, B3 on the resident load included
            self._load_speculator(model.draft)
        from transformers import AutoTokenizer

        source = self.options.tokenizer or model.id
        self.tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=True, local_files_only=True)
        self._facts["load_seconds"] = time.perf_counter() - start
        self._facts["nvtx"] = self._nvtx_placement()

    def _load_speculator(self, draft: str) -> None:
        import torch
        from moe_infinity.spec_decode import DFlashSpeculator

        self.speculator = DFlashSpeculator(self.moe, draft, dtype=getattr(torch, self.options.draft_dtype))
        enable = getattr(self.speculator, "enable_route_ahead_stats", None)
        if callable(enable):
            enable()
        self.draft_block_size = int(self.speculator.config.block_size)
        self._facts.update(draft=draft, draft_block_size=self.draft_block_size)

    def _nvtx_placement(self) -> dict[str, str]:
        """Who emits each upstream range: MoE-Infinity itself (PR #171), this adapter, or nobody."""
        around = "adapter, around DFlashSpeculator.{}".format
        library = self.build.library_nvtx
        return {
            "dflash_draft": "library" if library else around("draft_round"),
            "target_verify": "library" if library else around("verify_round"),
            "route_ahead_router": "library (gpt-oss router) when the build emits it; inside the forward, "
            "not placeable by the adapter",
            "route_ahead_issue": "inside MoE-Infinity's prefetcher; only the library can emit it",
            "expert_h2d": "inside MoE-Infinity's native copy engine; only the library can emit it",
        }

    def describe(self) -> dict[str, Any]:
        return dict(self._facts)

    def close(self) -> None:
        self.speculator = self.moe = self.tokenizer = None
        gc.collect()
        if self.cuda:
            import torch

            torch.cuda.empty_cache()

    # -- per cell -------------------------------------------------------------------------------------------
    def run_cell(self, cell: Cell) -> EngineResult:
        if cell.model != self.ctx.model.id:
            raise ValueError(
                f"cell {cell.cell_id} is for {cell.model}, this runner loaded {self.ctx.model.id}"
            )
        if self.refusal is not None:
            return self._without_metrics(Status.REFUSED, self.refusal)
        refused = self._gate(cell)
        if refused is not None:
            return refused
        plan = self._plan(cell)
        if isinstance(plan, EngineResult):
            return plan
        return self._measure(cell, plan)

    def _without_metrics(self, status: Status, reason: str) -> EngineResult:
        return EngineResult(status=status, reason=reason, engine=self.describe())

    def _gate(self, cell: Cell) -> EngineResult | None:
        """Upstream's refusal rule, the load-group contract, and what this build can express."""
        resident_load = self.ctx.load_group == "resident"
        if cell.offloaded == resident_load:
            raise RuntimeError(
                f"{cell.baseline} cell sent to the {self.ctx.load_group} load: the registry marks MoE-Infinity "
                "separate_resident_load, so B3 needs its own load and the offloaded baselines the shared one"
            )
        b = cell.baseline
        if cell.offloaded and self.num_offloaded <= 0:
            return self._without_metrics(
                Status.REFUSED,
                f"{b} must run with offloaded experts, but MoE-Infinity offloaded none at device_memory_ratio="
                f"{self.ratio}; lower memory.device_memory_ratio (below 0.9, e.g. 0.85) so experts are offloaded",
            )
        if not cell.offloaded and self.num_offloaded > 0:
            return self._without_metrics(
                Status.UNAVAILABLE_CAPACITY,
                f"B3 needs every expert resident, but {self.num_offloaded} experts stay offloaded at "
                f"resident_memory_ratio={self.ratio}: the model does not fit this device",
            )
        if not cell.speculative:
            return None
        if self.speculator is None:
            return self._without_metrics(
                Status.REFUSED, f"{b} needs a DFlash drafter: models[].draft is empty"
            )
        if self.draft_block_size is not None and cell.block_size > self.draft_block_size:
            return self._without_metrics(
                Status.REFUSED,
                f"block size {cell.block_size} exceeds the drafter's block size {self.draft_block_size}",
            )
        try:
            self.speculator.config.block_size = self.speculator.config.block_size
        except Exception as exc:
            return self._without_metrics(Status.REFUSED, f"cannot set the drafter's block size: {exc}")
        build = self.build
        sessions = build.verify_scheduler and build.session_seam
        if b in ("B2", "OURS") and not sessions:
            missing = [] if build.verify_scheduler else ["verify budgets in the serving Scheduler"]
            missing += (
                [] if build.session_seam else ["DFlashSpeculator begin_session/draft_round/verify_round"]
            )
            return self._without_metrics(
                Status.BLOCKED_UNTIL_2D_SCHEDULER,
                f"{b} needs MoE-Infinity's verify-round scheduler; this build lacks {' and '.join(missing)}",
            )
        if b in ("B1", "B2", "B3"):
            if not build.route_ahead_switch:
                return self._without_metrics(
                    Status.REFUSED,
                    f"{b} needs DFlash with route-ahead prefetch OFF, but this MoE-Infinity build has no "
                    f"DFlashSpeculator.{ROUTE_AHEAD_SEAM} hook to switch it off: {b} would silently use "
                    "OURS's prefetch path",
                )
            if getattr(getattr(self.moe, "engine_config", None), "speculative_prefetch", False):
                return self._without_metrics(
                    Status.REFUSED,
                    f"{b} needs route-ahead OFF, but the load config has speculative_prefetch on: the expert "
                    "executor would still prefetch routed experts during verify",
                )
        elif getattr(self.moe.engine, "expert_prefetcher", None) is None:
            return self._without_metrics(
                Status.REFUSED, "OURS needs route-ahead, but the offload engine exposes no expert_prefetcher"
            )
        if cell.concurrency > 1 and not (sessions and build.persistent_sessions):
            return self._without_metrics(
                Status.REFUSED,
                f"concurrency {cell.concurrency}: this MoE-Infinity build runs a speculative request to "
                "completion inside one serving step (no persistent speculative sessions), and a multi-request "
                "batch would silently decode autoregressively; only c=1 can be measured",
            )
        if not sessions and self.ctx.workload.temperature > 0:
            return self._without_metrics(
                Status.REFUSED,
                "the whole-request speculative path of this build is greedy-only (temperature 0)",
            )
        return None

    def _plan(self, cell: Cell) -> CellPlan | EngineResult:
        b, bs, c = cell.baseline, cell.block_size, cell.concurrency
        if not cell.speculative:
            return CellPlan(False, None, None, "ar_batched")
        sessions = self.build.verify_scheduler and self.build.session_seam
        if b in ("B1", "B3"):  # B3: B1's speculative path on the resident load (upstream's B3)
            if not sessions:
                return CellPlan(True, False, None, "spec_whole_request")
            budgets = _budgets(bs * c, bs * c, B2_UNBOUNDED_EXPERT_BYTES, B2_UNBOUNDED_EXPERT_BYTES)
            return CellPlan(True, False, budgets, "spec_sessions")
        choice = self.options.verify_token_budget
        tokens = bs if choice == "block" else bs * c if choice == "block_x_concurrency" else int(choice)
        if b == "B2":
            budgets = _budgets(tokens, max(tokens, bs), B2_UNBOUNDED_EXPERT_BYTES, B2_UNBOUNDED_EXPERT_BYTES)
            return CellPlan(True, False, budgets, "spec_sessions")
        if self.options.expert_byte_budget == "h2d_window":
            if self.h2d is None:
                return self._without_metrics(
                    Status.REFUSED,
                    "OURS's expert_byte_budget 'h2d_window' needs the probed host-to-device bandwidth, and there "
                    "is no CUDA device to probe; set engine_options.expert_byte_budget to a byte count",
                )
            byte_budget = max(1, int(self.h2d * self.options.expert_byte_window_seconds))
        else:
            byte_budget = int(self.options.expert_byte_budget)
        # The cap must cover the largest single demand (a verify routing every expert, M bytes).
        byte_cap = max(byte_budget, m.total_expert_bytes(self.moe.engine) or 0)
        return CellPlan(True, True, _budgets(tokens, max(tokens, bs), byte_budget, byte_cap), "spec_sessions")

    def _measure(self, cell: Cell, plan: CellPlan) -> EngineResult:
        workload, engine = self.ctx.workload, self.moe.engine
        spec = self.speculator if plan.speculative else None
        warnings: list[str] = []
        sources: dict[str, str] = {}
        timings: dict[str, float] = {}
        telemetry_start = nvml.telemetry(0) if self.cuda else None
        prompts = build_prompts(self.tokenizer, workload, workload.requests)
        warm = build_prompts(self.tokenizer, workload, workload.warmup_rounds, salt=1)
        with ExitStack() as stack:
            t = time.perf_counter()
            bindings: dict[str, int] = {}
            if spec is not None:
                stack.enter_context(_drafter_block_size(spec, cell.block_size))
                bindings = stack.enter_context(_route_ahead(spec, plan.route_ahead, self.build))
            serving = self._serving(cell, plan, spec, prompts + warm)
            stack.callback(self._release, serving)
            if plan.verify_budgets is not None and not getattr(
                getattr(serving, "scheduler", None), "verify_scheduling_enabled", False
            ):
                raise RuntimeError("verify budgets were passed but the serving scheduler did not enable them")
            timings["serving_setup_seconds"] = time.perf_counter() - t
            t = time.perf_counter()
            if warm:
                drive(
                    serving,
                    warm,
                    sampling_params=self._sampling(cell.block_size),
                    concurrency=min(cell.concurrency, len(warm)),
                    request_prefix="warmup-",
                    sync=self._sync,
                )
            timings["warmup_seconds"] = time.perf_counter() - t
            # Counters cover the timed loop only.
            if spec is not None and callable(getattr(spec, "enable_route_ahead_stats", None)):
                spec.enable_route_ahead_stats()
            if not m.call_if_present(
                engine, "expert_prefetcher", "expert_dispatcher", "clear_expert_cache_counts"
            ):
                warnings.append(m.HIT_RATE_CUMULATIVE)
            exposed_reset = m.call_if_present(engine, "reset_exposed_fetch_seconds")
            exposed_before, _ = m.exposed_fetch_seconds(engine)
            wasted_before, _ = m.native_wasted_prefetch_bytes(engine)
            rounds_cm = (
                record_rounds(spec, push_nvtx=not self.build.library_nvtx) if spec else nullcontext(None)
            )
            occupancy_peak: list[float] = []
            with rounds_cm as rounds, track_kv_peak(serving) as kv:

                def after_step() -> None:  # peaks over the timed loop, sampled after every serving step
                    if kv is not None:
                        kv.sample()
                    value, _ = m.expert_occupancy_bytes(engine)
                    if value is not None:
                        occupancy_peak.append(value)

                run = drive(
                    serving,
                    prompts,
                    sampling_params=self._sampling(cell.max_new_tokens),
                    concurrency=cell.concurrency,
                    request_prefix="req-",
                    sync=self._sync,
                    after_step=after_step,
                )
            timings["timed_seconds"] = run.elapsed
            stats = _route_ahead_dict(spec)
            hit, hit_src = m.hit_rate(engine)
            occupancy, occ_src = m.expert_occupancy_bytes(engine)
            if occupancy is not None:
                occupancy = max([occupancy, *occupancy_peak])
                occ_src = f"{occ_src} (peak over serving steps)"
            exposed_after, _ = m.exposed_fetch_seconds(engine)
            wasted_after, _ = m.native_wasted_prefetch_bytes(engine)
            kv_bytes, kv_src = self._kv_bytes(cell, kv)
        tokens = sum(t.tokens for t in run.traces)
        refused = _postconditions(cell, plan, rounds, stats, tokens, len(run.traces))
        if refused is not None:
            return self._without_metrics(Status.REFUSED, refused)

        # -- the ten metrics --------------------------------------------------------------------------------
        tps = tokens / run.elapsed
        if plan.speculative:
            a, histogram = m.acceptance(rounds.committed, cell.block_size)
            if a is None:
                warnings.append(m.ABSENT["acceptance_length_a"])
        else:
            a, histogram = 1.0, None  # autoregressive: one token per round by definition
        ttfts = [t.ttft for t in run.traces if t.ttft is not None]
        ttft = sum(ttfts) / len(ttfts) if ttfts else None
        gaps = [g for t in run.traces for g in t.chunk_gaps()]
        if gaps:
            per_round = sum(gaps) / len(gaps)
        elif plan.speculative and cell.concurrency == 1 and rounds.committed:
            # The request ran inside one serving step (no per-round stream); at c=1 the loop is sequential.
            per_round = run.elapsed / len(rounds.committed)
            sources["per_round_latency_seconds"] = "timed loop / observed verify rounds (no per-round stream)"
        else:
            per_round = None
            warnings.append(
                "per_round_latency_seconds absent: no request received tokens in two serving steps"
            )
        slo = self.ctx.slo
        good_tokens = sum(t.tokens for t in run.traces if m.meets_slo(t, slo.ttft_ms, slo.tpot_ms))
        goodput = good_tokens / run.elapsed

        coverage, wasted = self._prefetch_metrics(plan, stats, wasted_before, wasted_after, warnings, sources)
        if hit is None:
            warnings.append(m.ABSENT["expert_cache_hit_rate"] + (f" ({hit_src})" if hit_src else ""))
        else:
            sources["expert_cache_hit_rate"] = hit_src or ""
        if occupancy is None:
            warnings.append(m.ABSENT["expert_occupancy_bytes"] + (f" ({occ_src})" if occ_src else ""))
        else:
            sources["expert_occupancy_bytes"] = occ_src or ""
        if kv_bytes is None:
            warnings.append(m.ABSENT["kv_occupancy_bytes"])
        else:
            sources["kv_occupancy_bytes"] = kv_src or ""

        exposed = None
        if exposed_after is not None and (exposed_reset or exposed_before is not None):
            # Reset before the timed loop, or a delta over it; a counter unreadable before is no delta.
            exposed = exposed_after if exposed_reset else exposed_after - exposed_before
        else:
            warnings.append(m.ABSENT["exposed_fetch_seconds"])
        if self.h2d is None:
            warnings.append(m.ABSENT["measured_h2d_bytes_per_second"])
        cost_terms = CostTerms(
            route_ahead_coverage=coverage,
            wasted_prefetch_bytes=int(wasted) if wasted is not None else None,
            measured_h2d_bytes_per_second=self.h2d,
            h2d_bandwidth_source="probe" if self.h2d is not None else None,
            h2d_link=("real" if cell.offloaded else "none") if self.cuda else None,
            exposed_fetch_seconds=max(exposed, 0.0) if exposed is not None else None,
        )
        observed = m.observed_max_in_flight(run.traces)
        expected = min(cell.concurrency, len(run.traces))
        if observed < expected:
            warnings.append(
                f"concurrency {cell.concurrency} requested, but at most {observed} requests were observed in "
                "flight (between their first and last token)"
            )
        facts = {
            **self.describe(),
            "configuration": {
                "route_ahead": plan.route_ahead,
                "verify_budgets": plan.verify_budgets,
                "serving_path": plan.serving_path,
                "max_batch_size": cell.concurrency,
                "block_size": cell.block_size,
            },
            "observed_max_in_flight": observed,
            "serving_steps": run.steps,
            "metric_sources": sources,
        }
        if bindings:
            facts["route_ahead_bindings"] = dict(bindings)
        if stats is not None and not plan.route_ahead:
            facts["route_ahead_observer"] = stats  # route-ahead off: what the verify seam saw (predicted = 0)
        per_round_samples: dict[str, list[float]] = {}
        if rounds is not None:
            per_round_samples = {
                "draft_seconds": rounds.draft_seconds,
                "verify_seconds": rounds.verify_seconds,
            }
            if rounds.demand_bytes:
                facts["mean_verify_demand_bytes"] = sum(rounds.demand_bytes) / len(rounds.demand_bytes)
            if rounds.missing_accept:
                warnings.append(
                    f"{rounds.missing_accept} verify results carried no accept count (not counted)"
                )
        values = {
            "output_tokens_per_second": tps,
            "acceptance_length_a": a,
            "ttft_seconds": ttft,
            "per_round_latency_seconds": per_round,
            "goodput_at_slo": goodput,
            "expert_cache_hit_rate": hit,
            "route_ahead_prefetch_coverage": coverage,
            "wasted_prefetch_bytes": wasted,
            "expert_occupancy_bytes": occupancy,
            "kv_occupancy_bytes": kv_bytes,
        }
        telemetry_end = nvml.telemetry(0) if self.cuda else None
        telemetry = (
            {"start": telemetry_start, "end": telemetry_end} if telemetry_start or telemetry_end else None
        )
        return EngineResult(
            **values,
            status=Status.OK if all(v is not None for v in values.values()) else Status.PARTIAL,
            warnings=warnings,
            cost_terms=cost_terms,
            t_draft_seconds=sum(rounds.draft_seconds) if rounds and rounds.draft_seconds else None,
            t_verify_seconds=sum(rounds.verify_seconds) if rounds and rounds.verify_seconds else None,
            latency=m.latency_stats(run.traces, per_round_samples),
            acceptance_histogram=histogram,
            route_ahead=stats if plan.route_ahead else None,
            requests=len(run.traces),
            generated_tokens=tokens,
            timed_seconds=run.elapsed,
            engine=facts,
            telemetry=telemetry,
            timings=timings,
        )

    def _prefetch_metrics(self, plan, stats, wasted_before, wasted_after, warnings, sources):
        """Coverage and wasted bytes of the configuration's prefetcher (docs/metrics.md, metrics 7 and 8).

        OURS: route-ahead, from RouteAheadStats. B0-B3: MoE-Infinity's AR prefetcher, whose predictions no
        accessor exposes, so coverage is absent; wasted bytes come from the native waste counter (timed-loop
        delta) where the build has one, for OURS too when its statistics carried no byte sizes.
        """
        coverage = wasted = None
        if plan.route_ahead:
            if stats is None:
                warnings.append(m.NO_ROUTE_AHEAD_STATS)
            else:
                coverage = float(stats["coverage"])
                sources["route_ahead_prefetch_coverage"] = "RouteAheadStats.coverage"
                if not stats.get("actual_experts"):
                    warnings.append(m.VACUOUS_COVERAGE)
                if stats.get("wasted_prefetch_bytes") is not None:
                    wasted = float(stats["wasted_prefetch_bytes"])
                    sources["wasted_prefetch_bytes"] = "RouteAheadStats.wasted_prefetch_bytes"
        else:
            warnings.append(m.ABSENT["route_ahead_prefetch_coverage"])
        if wasted is None and wasted_after is not None and wasted_before is not None:
            wasted = max(wasted_after - wasted_before, 0.0)
            sources["wasted_prefetch_bytes"] = "expert_prefetcher.wasted_prefetch_bytes (timed-loop delta)"
        if wasted is None:
            warnings.append(m.ABSENT["wasted_prefetch_bytes"])
        return coverage, wasted

    # -- serving engine -------------------------------------------------------------------------------------
    def _geometry(self) -> dict[str, Any]:
        model = self.moe.model
        config = getattr(model, "config", None)
        text = getattr(config, "text_config", None) or config

        def field(*names: str) -> int | None:
            for n in names:
                v = getattr(text, n, None)
                if isinstance(v, int) and not isinstance(v, bool):
                    return v
            return None

        layers = field("num_hidden_layers", "num_layers")
        heads = field("num_attention_heads")
        kv_heads = field("num_key_value_heads") or heads
        head_dim = field("head_dim") or (
            field("hidden_size") // heads if heads and field("hidden_size") else None
        )
        dtype = str(getattr(model, "dtype", "bfloat16")).replace("torch.", "")
        if not (layers and kv_heads and head_dim) or dtype not in _ELEMENT_SIZE:
            raise RuntimeError(
                f"cannot size the serving KV cache from the model config: num_hidden_layers={layers}, "
                f"num_key_value_heads={kv_heads}, head_dim={head_dim}, dtype={dtype}"
            )
        return {"num_layers": layers, "num_kv_heads": kv_heads, "head_dim": head_dim, "dtype": dtype}

    def _serving(self, cell: Cell, plan: CellPlan, spec: Any, prompts: list[list[int]]) -> Any:
        from moe_infinity.serving.engine import ContinuousBatchingEngine

        geometry = self._geometry()
        bs, c = cell.block_size, max(1, cell.concurrency)
        longest = max(len(p) for p in prompts)
        config: dict[str, Any] = {
            **self.options.serving_config,
            **geometry,
            "block_size": bs,
            "num_kv_blocks": math.ceil((longest + cell.max_new_tokens + bs) / bs) * c + c,
            "max_batch_size": c,
            "device_memory_ratio": self.ratio,
            **(plan.verify_budgets or {}),
        }
        if self.options.ignore_eos:
            config["eos_token_id"] = -1  # never produced: every request generates max_new_tokens
        return ContinuousBatchingEngine(
            model=self.moe.model,
            engine=self.moe.engine,
            config=config,
            tokenizer=None,
            speculative_draft=spec,
        )

    def _sampling(self, max_tokens: int):
        from moe_infinity.serving.sequence import SamplingParams

        temperature = float(self.ctx.workload.temperature)
        return lambda: SamplingParams(temperature=temperature, top_k=0, top_p=1.0, max_tokens=int(max_tokens))

    def _kv_bytes(self, cell: Cell, kv: Any) -> tuple[float | None, str | None]:
        if kv is not None and kv.peak_blocks > 0:
            g = self._geometry()
            per_block = g["num_layers"] * 2 * cell.block_size * g["num_kv_heads"] * g["head_dim"]
            return float(kv.peak_blocks * per_block * _ELEMENT_SIZE[g["dtype"]]), (
                "serving PagedKVCache: peak blocks in use x block bytes"
            )
        return m.native_kv_occupancy_bytes(self.moe.engine)

    def _sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    def _release(self, serving: Any) -> None:
        shutdown = getattr(serving, "shutdown", None)
        if callable(shutdown):
            shutdown()
        gc.collect()
        if self.cuda:
            import torch

            torch.cuda.empty_cache()


def _budgets(tokens: int, token_cap: int, expert_bytes: int, byte_cap: int) -> dict[str, int]:
    return {
        "verify_token_budget": int(tokens),
        "verify_token_deficit_cap": int(token_cap),
        "verify_expert_byte_budget": int(expert_bytes),
        "verify_expert_byte_deficit_cap": int(byte_cap),
    }


@contextmanager
def _drafter_block_size(speculator: Any, block_size: int) -> Iterator[None]:
    """DFlash drafts ``config.block_size`` tokens per round; a cell's B may be below the trained block size."""
    config = speculator.config
    previous = config.block_size
    config.block_size = block_size
    try:
        yield
    finally:
        config.block_size = previous


@contextmanager
def _route_ahead(speculator: Any, on: bool | None, build: Build) -> Iterator[dict[str, int]]:
    """Bind (ON) or withhold (OFF) the verify-time route-ahead prefetcher; count what was bound."""
    bindings = {"bound": 0, "withheld": 0}
    if on is None or not build.route_ahead_switch:
        yield bindings
        return
    original = getattr(speculator, ROUTE_AHEAD_SEAM)

    def resolve() -> Any:
        prefetcher = original() if on else None
        bindings["bound" if prefetcher is not None else "withheld"] += 1
        return prefetcher

    setattr(speculator, ROUTE_AHEAD_SEAM, resolve)
    try:
        yield bindings
    finally:
        delattr(speculator, ROUTE_AHEAD_SEAM)


def _route_ahead_dict(speculator: Any) -> dict[str, Any] | None:
    stats = getattr(speculator, "route_ahead_stats", None) if speculator is not None else None
    as_dict = getattr(stats, "as_dict", None)
    if not callable(as_dict):
        return None
    raw = as_dict()
    return {k: raw[k] for k in ROUTE_AHEAD_KEYS if k in raw}


def _postconditions(cell, plan, rounds, stats, tokens: int, requests: int) -> str | None:
    """Refuse a measurement that did not run the configuration it is labelled with."""
    no_rounds = plan.speculative and rounds is not None and not rounds.committed and not rounds.missing_accept
    if no_rounds and tokens > requests:  # more than each request's first token, yet no verify round
        return (
            f"the serving engine generated {tokens} tokens without a single DFlash verify round (it fell back "
            f"to autoregressive decoding); refusing to report that as {cell.baseline}"
        )
    if plan.route_ahead is False and stats and (stats.get("predicted_experts") or 0) > 0:
        return (
            f"route-ahead was switched off for {cell.baseline}, yet RouteAheadStats counted "
            f"{stats['predicted_experts']} predicted experts: the switch did not take on this build"
        )
    return None
