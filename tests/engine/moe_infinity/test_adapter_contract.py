"""Contract tests of the MoE-Infinity adapter against the fake ``moe_infinity`` package (tests/engine/moe_infinity/fake_moe_infinity).

The fake implements the documented surface and records every call, so these tests check what the adapter asks
MoE-Infinity to do per configuration, how it refuses what a build cannot express, and how it reads metrics.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pd_dflash.engine.moe_infinity import metrics as m
from pd_dflash.engine.moe_infinity.cells import B2_UNBOUNDED_EXPERT_BYTES
from pd_dflash.engine.moe_infinity.engine import MoEInfinityEngine
from pd_dflash.errors import InputError
from pd_dflash.schema import Status
from pd_dflash.upstream import REQUIRED_METRICS
from tests.engine.moe_infinity.fakes import (
    FAKE_ROOT,
    MODEL,
    REPO,
    SMALL,
    cell,
    context,
    fake_engine,
    make_spec,
    run,
    spec_data,
    stored_row,
)


def _calls(fake, name):
    return [c for c in fake.CALLS if c["call"] == name]


class Ledger:
    """The fake expert cache's raw events, recorded under the adapter: the oracle for what the adapter reads.

    From these alone (not through any accessor the adapter uses) the timed loop's hit rate, on-demand fetch time,
    wasted prefetch bytes and peak expert occupancy are recomputed. The timed loop starts at the adapter's last
    ``clear_expert_cache_counts`` (or at the load when the build has none).
    """

    def __init__(self, monkeypatch) -> None:
        from moe_infinity import runtime

        self.events: list[tuple] = []
        engine, dispatcher = runtime.OffloadEngine, runtime.NativeDispatcher
        access, load = engine.access, engine.load

        def recorded_access(this, layer, expert):
            self.events.append(("access", (layer, expert) in this.cache))
            access(this, layer, expert)

        def recorded_load(this, key, *, prefetched):
            cached, wasted = key in this.cache, this.wasted_bytes
            load(this, key, prefetched=prefetched)
            fetched = not cached and not prefetched  # an on-demand fetch
            self.events.append(("load", fetched, this.wasted_bytes - wasted, len(this.cache)))

        monkeypatch.setattr(engine, "access", recorded_access)
        monkeypatch.setattr(engine, "load", recorded_load)
        clear = getattr(dispatcher, "clear_expert_cache_counts", None)
        if clear is not None:

            def recorded_clear(this):
                self.events.append(("clear",))
                clear(this)

            monkeypatch.setattr(dispatcher, "clear_expert_cache_counts", recorded_clear)

    def timed(self) -> list[tuple]:
        starts = [i for i, e in enumerate(self.events) if e[0] == "clear"]
        return self.events[starts[-1] + 1 :] if starts else self.events

    def hit_rate(self) -> float:
        hits = [e[1] for e in self.timed() if e[0] == "access"]
        return sum(hits) / len(hits)

    def on_demand_fetch_seconds(self) -> float:
        from moe_infinity._world import EXPERT_NBYTES, LINK_BYTES_PER_SECOND

        return sum(EXPERT_NBYTES / LINK_BYTES_PER_SECOND for e in self.timed() if e[0] == "load" and e[1])

    def wasted_bytes(self) -> int:
        return sum(e[2] for e in self.timed() if e[0] == "load")

    def peak_occupancy_bytes(self) -> int:
        from moe_infinity._world import EXPERT_NBYTES

        return max(e[3] for e in self.events if e[0] == "load") * EXPERT_NBYTES


def test_adapter_module_imports_neither_moe_infinity_nor_torch():
    code = (
        "import sys; import pd_dflash.engine.moe_infinity.options, pd_dflash.engine.moe_infinity.features; "
        "assert 'torch' not in sys.modules, 'options/features imported torch'; "
        "import pd_dflash.engine.moe_infinity.engine; "
        "assert 'moe_infinity' not in sys.modules, 'engine module imported moe_infinity'"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(FAKE_ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr


def test_calls_per_configuration(monkeypatch, spec):
    fake, engine = fake_engine(monkeypatch, spec)
    load = _calls(fake, "MoE")
    assert load == [
        {
            "call": "MoE",
            "model": MODEL,
            "config": {
                "offload_path": spec.models[0].offload_dir,
                "device_memory_ratio": 0.85,
                # set explicitly, so ArcherConfig.__post_init__ cannot cut the device ratio (docs/moe-infinity.md)
                "kv_cache_memory_ratio": 0.15,
            },
            "applied": {"device_memory_ratio": 0.85, "kv_cache_memory_ratio": 0.15},
            "pid": os.getpid(),
        }
    ]
    assert len(_calls(fake, "DFlashSpeculator")) == 1
    facts = {}
    for baseline in ("B0", "B1", "B2", "OURS"):
        result = run(engine, cell(spec, baseline, None if baseline == "B0" else 8, 3))
        assert result.status in (Status.OK, Status.PARTIAL), result.reason
        facts[baseline] = result.engine
    configs = [c["config"] for c in _calls(fake, "ContinuousBatchingEngine")]
    speculative = [c["speculative"] for c in _calls(fake, "ContinuousBatchingEngine")]
    assert speculative == [False, True, True, True]
    assert [c["block_size"] for c in configs] == [4, 8, 8, 8]  # B0 is measured once, at the smallest B
    assert all(c["max_batch_size"] == 3 for c in configs)
    assert all(c["device_memory_ratio"] == 0.85 and c["eos_token_id"] == -1 for c in configs)
    b0, b1, b2, ours = configs
    assert "verify_token_budget" not in b0
    # B1: route-ahead off, every pending verify admitted each step (non-binding budgets).
    assert (b1["verify_token_budget"], b1["verify_token_deficit_cap"]) == (24, 24)
    assert b1["verify_expert_byte_budget"] == B2_UNBOUNDED_EXPERT_BYTES
    # B2: upstream's build_b2_serving_config: token budget = cap = B, expert bytes unbounded, route-ahead off.
    assert (b2["verify_token_budget"], b2["verify_token_deficit_cap"]) == (8, 8)
    assert (
        b2["verify_expert_byte_budget"] == b2["verify_expert_byte_deficit_cap"] == B2_UNBOUNDED_EXPERT_BYTES
    )
    # OURS: the 2-D budgets, with the byte cap covering a verify that routes every expert (M = 64 MB).
    assert (ours["verify_token_budget"], ours["verify_expert_byte_budget"]) == (8, 32_000_000)
    assert ours["verify_expert_byte_deficit_cap"] == 64_000_000
    # What each configuration switched, as the rows record it.
    assert facts["B0"]["configuration"]["route_ahead"] is None
    assert facts["B1"]["configuration"]["route_ahead"] is False
    assert facts["B2"]["configuration"]["route_ahead"] is False
    assert facts["OURS"]["configuration"]["route_ahead"] is True
    assert facts["B1"]["route_ahead_bindings"]["bound"] == 0 < facts["B1"]["route_ahead_bindings"]["withheld"]
    assert (
        facts["OURS"]["route_ahead_bindings"]["withheld"]
        == 0
        < facts["OURS"]["route_ahead_bindings"]["bound"]
    )
    assert facts["B1"]["configuration"] != facts["OURS"]["configuration"]
    assert facts["B1"]["route_ahead_observer"]["predicted_experts"] == 0
    assert facts["OURS"]["fake"] is True and facts["OURS"]["version"] == "0.0.0+fake"


def test_b3_gets_its_own_resident_load(monkeypatch, spec):
    fake, engine = fake_engine(monkeypatch, spec, load_group="resident")
    assert _calls(fake, "MoE")[0]["config"]["device_memory_ratio"] == 0.98
    assert len(_calls(fake, "DFlashSpeculator")) == 1  # B3 is speculative: the drafter on the resident load
    result = run(engine, cell(spec, "B3", 8, concurrency=1))
    assert result.status is Status.PARTIAL  # coverage of MoE-Infinity's AR prefetcher is not observable
    assert result.engine["configuration"]["route_ahead"] is False  # B1's path, every expert resident
    with pytest.raises(RuntimeError, match="separate_resident_load"):
        run(engine, cell(spec, "B0", concurrency=1))


def test_concurrency_is_c_requests_in_flight(monkeypatch, spec):
    fake, engine = fake_engine(monkeypatch, spec)
    for baseline, c in (("B0", 3), ("OURS", 3), ("B0", 1), ("OURS", 1)):
        result = run(engine, cell(spec, baseline, 8 if baseline == "OURS" else None, c))
        shutdown = _calls(fake, "shutdown")[-1]
        assert shutdown["max_in_flight"] == c, (baseline, c)
        assert result.engine["observed_max_in_flight"] == c
        assert result.requests == 4
        assert result.generated_tokens == 4 * 16  # ignore_eos: every request generates max_new_tokens
        assert not [w for w in result.warnings if w.startswith("concurrency")]


def test_full_surface_ours_row_is_ok_with_measured_metrics(monkeypatch, spec):
    _, engine = fake_engine(monkeypatch, spec)
    ledger = Ledger(monkeypatch)
    result = run(engine, cell(spec, "OURS", 8, 3))
    row = stored_row(spec, "OURS", 8, 3, result)
    assert row.status is Status.OK, row.warnings
    assert row.missing_metrics() == []
    assert 1.0 < row.acceptance_length_a <= 8
    # τ is the mean of the per-round commits the verify seam returned, never a fallback.
    hist = row.acceptance_histogram
    assert sum(k * v for k, v in hist.items()) / sum(hist.values()) == pytest.approx(row.acceptance_length_a)
    assert row.route_ahead["steps"] == sum(hist.values())
    assert row.route_ahead_prefetch_coverage == row.route_ahead["coverage"] == 1.0
    assert row.wasted_prefetch_bytes == row.route_ahead["wasted_prefetch_bytes"] > 0
    # Hit rate, occupancy and exposed fetch time recomputed from the fake cache's own events in the timed loop.
    assert row.expert_cache_hit_rate == pytest.approx(ledger.hit_rate(), abs=1e-12)
    assert 0.0 < row.expert_cache_hit_rate < 1.0
    assert row.expert_occupancy_bytes == ledger.peak_occupancy_bytes()
    assert row.cost_terms.exposed_fetch_seconds == pytest.approx(ledger.on_demand_fetch_seconds(), rel=1e-12)
    assert row.cost_terms.exposed_fetch_seconds > 0
    assert row.kv_occupancy_bytes > 0
    # τ and the draft/verify sums are over the same rounds: the histogram counts every verify round.
    assert row.latency["verify_seconds"].n == sum(hist.values())
    assert row.t_verify_seconds == pytest.approx(row.latency["verify_seconds"].mean * sum(hist.values()))
    assert row.t_draft_seconds > 0 and row.t_verify_seconds > 0
    assert {
        "ttft_seconds",
        "tpot_seconds",
        "e2e_seconds",
        "round_seconds",
        "verify_seconds",
    } <= row.latency.keys()
    assert row.cost_terms.route_ahead_coverage == 1.0
    assert m.ABSENT["measured_h2d_bytes_per_second"] in row.warnings  # CPU: nothing to probe
    assert row.engine["nvtx"]["dflash_draft"].startswith("adapter")  # the fake emits no NVTX itself


def test_ar_prefetcher_coverage_is_absent_not_zero(monkeypatch, spec):
    _, engine = fake_engine(monkeypatch, spec)
    ledger = Ledger(monkeypatch)
    for baseline, block in (("B0", None), ("B1", 4), ("B2", 4)):
        result = run(engine, cell(spec, baseline, block, 1))
        row = stored_row(spec, baseline, block or 4, 1, result)
        assert row.status is Status.PARTIAL
        assert row.missing_metrics() == ["route_ahead_prefetch_coverage"]
        assert m.ABSENT["route_ahead_prefetch_coverage"] in row.warnings
        # the native waste counter over the timed loop: unused prefetches the cache evicted in it (none here:
        # the fake's AR prefetcher fetches nothing ahead, and B1/B2 withhold route-ahead)
        assert row.wasted_prefetch_bytes == ledger.wasted_bytes() == 0
        assert row.expert_cache_hit_rate == pytest.approx(ledger.hit_rate(), abs=1e-12)
        assert row.engine["metric_sources"]["wasted_prefetch_bytes"].startswith("expert_prefetcher")


@pytest.mark.parametrize(
    ("disable", "absent"),
    [
        (("hit_rate",), ["expert_cache_hit_rate"]),
        (("occupancy",), ["expert_occupancy_bytes"]),
        (("wasted_bytes",), ["wasted_prefetch_bytes"]),
        (("route_ahead_stats", "wasted_bytes"), ["route_ahead_prefetch_coverage", "wasted_prefetch_bytes"]),
    ],
)
def test_metric_without_accessor_is_absent_with_warning(monkeypatch, spec, disable, absent):
    _, engine = fake_engine(monkeypatch, spec, disable=disable)
    result = run(engine, cell(spec, "OURS", 8, 1))
    row = stored_row(spec, "OURS", 8, 1, result)
    assert row.status is Status.PARTIAL
    assert row.missing_metrics() == absent
    for metric in absent:
        assert any(w.startswith(metric) and "absent" in w for w in row.warnings), row.warnings
    stored = row.to_json_dict()
    assert all(metric not in stored for metric in absent)  # absent, never 0.0
    assert all(stored[k] is not None for k in REQUIRED_METRICS if k not in absent)


def test_ours_waste_without_route_ahead_byte_sizes_is_the_native_counters_timed_loop_delta(monkeypatch, spec):
    _, engine = fake_engine(monkeypatch, spec, disable=("route_ahead_stats",))
    ledger = Ledger(monkeypatch)
    result = run(engine, cell(spec, "OURS", 8, 3))
    assert result.wasted_prefetch_bytes == ledger.wasted_bytes()
    assert result.engine["metric_sources"]["wasted_prefetch_bytes"].endswith("(timed-loop delta)")


def test_kv_without_allocator_or_native_accessor_is_absent(monkeypatch, spec):
    _, engine = fake_engine(monkeypatch, spec, disable=("kv_allocator",))
    row = stored_row(spec, "B0", 4, 1, run(engine, cell(spec, "B0", None, 1)))
    assert row.kv_occupancy_bytes is None and "kv_occupancy_bytes" in row.missing_metrics()
    assert m.ABSENT["kv_occupancy_bytes"] in row.warnings


def test_hit_rate_without_counter_reset_is_flagged(monkeypatch, spec):
    _, engine = fake_engine(monkeypatch, spec, disable=("clear_counts", "exposed_fetch"))
    ledger = Ledger(monkeypatch)
    result = run(engine, cell(spec, "OURS", 8, 1))
    # Nothing restarts the counters: the hit rate covers every access since the load, warm-up included.
    assert ledger.timed() == ledger.events
    assert result.expert_cache_hit_rate == pytest.approx(ledger.hit_rate(), abs=1e-12)
    assert m.HIT_RATE_CUMULATIVE in result.warnings
    # fetches bypass the timer: its 0.0 is contradicted by the cache misses (docs/moe-infinity.md)
    assert any(w.startswith("exposed_fetch_seconds absent") for w in result.warnings), result.warnings
    assert result.cost_terms.exposed_fetch_seconds is None


def test_refusal_rule_offloaded_without_offloaded_experts(monkeypatch, spec):
    _, engine = fake_engine(monkeypatch, spec, disable=("offload",))
    for baseline, block in (("B0", None), ("B1", 8), ("B2", 8), ("OURS", 8)):
        result = run(engine, cell(spec, baseline, block, 1))
        assert result.status is Status.REFUSED
        assert "offloaded none" in result.reason and "below 0.9" in result.reason
        assert result.present_metrics() == []


def test_b3_that_does_not_fit_is_unavailable_capacity(monkeypatch, spec):
    _, engine = fake_engine(monkeypatch, spec, load_group="resident", disable=("resident_fit",))
    result = run(engine, cell(spec, "B3", concurrency=1))
    assert result.status is Status.UNAVAILABLE_CAPACITY
    assert "stay offloaded" in result.reason


def test_build_without_verify_scheduler(monkeypatch, spec):
    _, engine = fake_engine(monkeypatch, spec, disable=("verify_scheduler",))
    for baseline in ("B2", "OURS"):
        result = run(engine, cell(spec, baseline, 8, 1))
        assert result.status is Status.BLOCKED_UNTIL_2D_SCHEDULER
        assert "verify budgets in the serving Scheduler" in result.reason
    # B1 at c=1 still runs: one whole-request generate per request, τ from the speculator's step trace.
    b1 = run(engine, cell(spec, "B1", 8, 1))
    assert b1.status is Status.PARTIAL and b1.engine["configuration"]["serving_path"] == "spec_whole_request"
    assert b1.acceptance_length_a > 1.0 and sum(b1.acceptance_histogram.values()) > 0
    # ... but not at c=3: a multi-request batch would silently decode autoregressively.
    refused = run(engine, cell(spec, "B1", 8, 3))
    assert refused.status is Status.REFUSED and "autoregressively" in refused.reason


def test_build_without_persistent_sessions_refuses_speculative_concurrency(monkeypatch, spec):
    _, engine = fake_engine(monkeypatch, spec, disable=("persistent_sessions",))
    assert run(engine, cell(spec, "OURS", 8, 3)).status is Status.REFUSED
    assert run(engine, cell(spec, "B0", None, 3)).status is Status.PARTIAL  # AR batching is unaffected
    ours = run(engine, cell(spec, "OURS", 8, 1))
    assert ours.status is Status.OK and ours.engine["configuration"]["serving_path"] == "spec_sessions"


def test_build_without_route_ahead_switch(monkeypatch, spec):
    _, engine = fake_engine(monkeypatch, spec, disable=("route_ahead_seam",))
    for baseline in ("B1", "B2"):
        result = run(engine, cell(spec, baseline, 8, 1))
        assert result.status is Status.REFUSED
        assert "_resolve_route_ahead_prefetcher" in result.reason and "OURS" in result.reason
    assert run(engine, cell(spec, "OURS", 8, 1)).status is Status.OK


def test_switch_that_does_not_take_is_caught(monkeypatch, spec):
    _, engine = fake_engine(monkeypatch, spec, faults=("ignore_route_ahead_switch",))
    result = run(engine, cell(spec, "B1", 8, 1))
    assert result.status is Status.REFUSED and "did not take" in result.reason


def test_autoregressive_fallback_is_not_reported_as_speculative(monkeypatch, spec):
    _, engine = fake_engine(monkeypatch, spec, faults=("ar_fallback",))
    result = run(engine, cell(spec, "OURS", 8, 1))
    assert result.status is Status.REFUSED and "without a single DFlash verify round" in result.reason


def test_block_size_above_the_drafters_is_refused(monkeypatch, tmp_path, tokenizer_dir):
    spec = make_spec(tmp_path, tokenizer_dir, block_sizes=[8, 32], **SMALL)
    _, engine = fake_engine(monkeypatch, spec)
    result = run(engine, cell(spec, "OURS", 32, 1))
    assert result.status is Status.REFUSED and "drafter's block size 16" in result.reason


def test_model_without_draft_refuses_speculative_cells(monkeypatch, tmp_path, tokenizer_dir):
    data = spec_data(tmp_path, tokenizer_dir, **SMALL)
    data["models"][0]["draft"] = ""
    spec = make_spec(tmp_path, tokenizer_dir, models=data["models"], **SMALL)
    _, engine = fake_engine(monkeypatch, spec)
    assert run(engine, cell(spec, "B1", 8, 1)).status is Status.REFUSED
    assert run(engine, cell(spec, "B0", None, 1)).status is Status.PARTIAL


def test_h2d_window_budget_needs_a_probe(monkeypatch, tmp_path, tokenizer_dir):
    spec = make_spec(tmp_path, tokenizer_dir, engine_options={"expert_byte_budget": "h2d_window"}, **SMALL)
    _, engine = fake_engine(monkeypatch, spec)
    result = run(engine, cell(spec, "OURS", 8, 1))
    assert result.status is Status.REFUSED and "expert_byte_budget" in result.reason


def test_one_model_per_process(monkeypatch, spec):
    _, engine = fake_engine(monkeypatch, spec)
    with pytest.raises(RuntimeError, match="one MoE-Infinity model per runner process"):
        MoEInfinityEngine(context(spec, "resident"))
    engine.close()
    with pytest.raises(
        RuntimeError, match="already loaded"
    ):  # closing frees Python objects, not native state
        MoEInfinityEngine(context(spec))


def test_env_is_visible_when_moe_infinity_is_imported(tmp_path, tokenizer_dir):
    """A fresh process that applies spec.env first (as the runner does) and then builds the engine."""
    spec = make_spec(tmp_path, tokenizer_dir, **SMALL)
    record = tmp_path / "records"
    code = f"""
import json, os, sys
from tests.engine.moe_infinity.fakes import context, make_spec
from pathlib import Path
spec = make_spec(Path({str(tmp_path)!r}), Path({str(tokenizer_dir)!r}), **{SMALL!r})
os.environ.update(spec.env)
from pd_dflash.engine.moe_infinity.engine import MoEInfinityEngine
engine = MoEInfinityEngine(context(spec))
import moe_infinity
print(json.dumps({{"seen": moe_infinity.IMPORT_ENVIRON.get("MOE_DISABLE_CUDA_GRAPHS"),
                   "facts": engine.describe()["import_environment"]}}))
"""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(FAKE_ROOT), str(REPO)]),
        "FAKE_MOE_INFINITY_RECORD_DIR": str(record),
    }
    env.pop("MOE_DISABLE_CUDA_GRAPHS", None)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["seen"] == spec.env["MOE_DISABLE_CUDA_GRAPHS"] == "1"
    assert out["facts"]["MOE_DISABLE_CUDA_GRAPHS"] == "1"
    (imported,) = record.glob("import-*.json")
    assert json.loads(imported.read_text())["environ"]["HF_HUB_OFFLINE"] == "1"


def test_options_are_validated_at_plan_time(tmp_path, tokenizer_dir):
    with pytest.raises(InputError, match=r"models\.0\.engine_options\.moe_config"):
        make_spec(tmp_path, tokenizer_dir, engine_options={"moe_config": {"device_memory_ratio": 0.5}})
    with pytest.raises(InputError, match=r"engine_options\.serving_config"):
        make_spec(tmp_path, tokenizer_dir, engine_options={"serving_config": {"max_batch_size": 2}})
    with pytest.raises(InputError, match=r"engine_options\.bogus"):
        make_spec(tmp_path, tokenizer_dir, engine_options={"bogus": 1})


def test_without_moe_infinity_plan_works_and_preflight_says_how_to_fix(tmp_path):
    """No moe_infinity on the path: `plan` of the Phase-A spec works; the runner-side preflight explains."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    plan = subprocess.run(
        [sys.executable, "-m", "pd_dflash", "plan", "jobs/phase_a.yaml"],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
    )
    assert plan.returncode == 0, plan.stderr
    assert "engine moe_infinity" in plan.stdout
    code = (
        "import json; from pd_dflash.sweep.preflight import check_engine_importable; "
        "print(json.dumps(check_engine_importable('moe_infinity', {})))"
    )
    check = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert check.returncode == 0, check.stderr
    result = json.loads(check.stdout.strip().splitlines()[-1])
    assert result["ok"] is False and "moe_infinity" in result["error"]
    assert "docs/operators.md" in result["error"]  # the install hint reaches the operator
    from pd_dflash.engine.registry import traits

    assert "docs/operators.md" in traits("moe_infinity").install_hints["moe_infinity"]
