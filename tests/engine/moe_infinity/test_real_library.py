"""Contract tests for what the real MoE-Infinity does and the first fake hid (issue 13, items 1-7; issue 12's
``trust_remote_code`` and B3 items).

The fake mirrors the real functions named in its module docstrings (repository, path, commit); each test below
names the item it covers. docs/moe-infinity.md maps every row field to its library source.
"""

from __future__ import annotations

import pytest
import yaml

from pd_dflash.engine.moe_infinity import metrics as m
from pd_dflash.schema import Row, Status
from pd_dflash.spec import parse_spec
from tests.engine.moe_infinity.fakes import (
    REPO,
    SMALL,
    cell,
    fake_engine,
    import_fake,
    make_spec,
    run,
    stored_row,
)

#: The fake target's KV bytes per token: 4 layers x (K, V) x 2 KV heads x head_dim 8 x bf16.
TOKEN_KV_BYTES = 4 * 2 * 2 * 8 * 2


# -- item 1: sessions feed a per-session RouteUnionCollector, not route_ahead_stats ----------------------------
@pytest.mark.parametrize("concurrency", [1, 3])
def test_ours_coverage_is_measured_through_the_sessions_collector(monkeypatch, spec, concurrency):
    fake, engine = fake_engine(monkeypatch, spec)
    result = run(engine, cell(spec, "OURS", 8, concurrency))
    row = stored_row(spec, "OURS", 8, concurrency, result)
    sessions = [c for c in fake.CALLS if c["call"] == "ContinuousBatchingEngine"]
    assert sessions and row.status is Status.OK, (row.reason, row.warnings)
    stats = row.route_ahead
    assert stats["steps"] == sum(row.acceptance_histogram.values()) > 0  # every verify round was recorded
    assert stats["actual_experts"] > 0 and stats["predicted_experts"] > 0
    assert m.VACUOUS_COVERAGE not in row.warnings
    assert row.route_ahead_prefetch_coverage == stats["coverage"]
    assert row.wasted_prefetch_bytes == stats["wasted_prefetch_bytes"] > 0
    assert row.engine["metric_sources"]["route_ahead_prefetch_coverage"].startswith("RouteAheadStats")


def test_route_ahead_off_is_checked_through_the_sessions_collector(monkeypatch, spec):
    _, engine = fake_engine(monkeypatch, spec, faults=("ignore_route_ahead_switch",))
    for baseline in ("B1", "B2"):
        result = run(engine, cell(spec, baseline, 8, 3))
        assert result.status is Status.REFUSED and "did not take" in result.reason


def test_route_ahead_that_records_nothing_fails_the_row(monkeypatch, spec):
    """gpt-oss: no MoE layer reaches the executor's route-ahead seam, so coverage would be a vacuous 1.0."""
    _, engine = fake_engine(monkeypatch, spec, faults=("experts_bypass_executor",))
    result = run(engine, cell(spec, "OURS", 8, 1))
    assert result.status is Status.REFUSED
    assert "route-ahead recorded nothing" in result.reason


# -- item 2: ArcherConfig.__post_init__ cuts 0.98 to 0.85; the row records the applied ratio -------------------
def test_b3_is_pinned_to_its_resident_ratio(monkeypatch, spec):
    fake, engine = fake_engine(monkeypatch, spec, load_group="resident")
    (load,) = [c for c in fake.CALLS if c["call"] == "MoE"]
    assert load["config"]["kv_cache_memory_ratio"] == pytest.approx(0.02)
    assert load["applied"]["device_memory_ratio"] == pytest.approx(0.98)
    result = run(engine, cell(spec, "B3", concurrency=1))
    assert result.status is Status.PARTIAL, result.reason  # resident, measured (AR coverage is unobservable)
    assert result.engine["device_memory_ratio"] == load["applied"]["device_memory_ratio"]
    assert result.engine["kv_cache_memory_ratio"] == load["applied"]["kv_cache_memory_ratio"]


def test_a_ratio_the_library_did_not_apply_is_refused_with_the_reason(monkeypatch, tmp_path, tokenizer_dir):
    spec = make_spec(tmp_path, tokenizer_dir, memory={"resident_memory_ratio": 1.0}, **SMALL)
    fake, engine = fake_engine(monkeypatch, spec, load_group="resident")
    (load,) = [c for c in fake.CALLS if c["call"] == "MoE"]
    result = run(engine, cell(spec, "B3", concurrency=1))
    assert result.status is Status.REFUSED
    assert "applied device_memory_ratio=0.85" in result.reason and "1.0" in result.reason
    assert result.engine["device_memory_ratio"] == load["applied"]["device_memory_ratio"] == 0.85


def test_build_without_the_kv_split_gets_no_kv_ratio(monkeypatch, spec):
    fake, engine = fake_engine(monkeypatch, spec, load_group="resident", disable=("kv_ratio_field",))
    (load,) = [c for c in fake.CALLS if c["call"] == "MoE"]
    assert "kv_cache_memory_ratio" not in load["config"]
    assert run(engine, cell(spec, "B3", concurrency=1)).status is Status.PARTIAL
    assert engine.describe()["device_memory_ratio"] == 0.98


# -- item 3: the library's getters return 0.0 when the native getter is missing ---------------------------------
@pytest.mark.parametrize(
    ("disable", "metric"),
    [
        (("hit_rate",), "expert_cache_hit_rate"),
        (("occupancy",), "expert_occupancy_bytes"),
        (("wasted_bytes",), "wasted_prefetch_bytes"),
    ],
)
def test_a_wrappers_zero_without_a_native_getter_is_absent(monkeypatch, spec, disable, metric):
    _, engine = fake_engine(monkeypatch, spec, disable=disable)
    row = stored_row(spec, "B0", 4, 1, run(engine, cell(spec, "B0", concurrency=1)))
    assert getattr(row, metric) is None and metric in row.missing_metrics()
    assert any(w.startswith(metric) and "0.0" in w and "native" in w for w in row.warnings), row.warnings


def test_exposed_fetch_without_a_fetch_timer_is_absent(monkeypatch, spec):
    _, engine = fake_engine(monkeypatch, spec, disable=("exposed_fetch",))
    result = run(engine, cell(spec, "B0", concurrency=1))
    assert result.cost_terms.exposed_fetch_seconds is None
    assert any(w.startswith("exposed_fetch_seconds absent") for w in result.warnings), result.warnings


def test_an_implausible_native_zero_is_flagged(monkeypatch, spec):
    _, engine = fake_engine(monkeypatch, spec, faults=("hit_counters_stalled",))
    row = stored_row(spec, "B0", 4, 1, run(engine, cell(spec, "B0", concurrency=1)))
    assert row.expert_cache_hit_rate is None
    flagged = [w for w in row.warnings if w.startswith("expert_cache_hit_rate")]
    assert flagged and "implausible" in flagged[0], row.warnings


def test_native_zero_that_is_plausible_is_kept(monkeypatch, spec):
    """B3 on the resident load fetches nothing on demand: an exposed fetch time of 0.0 is the measurement."""
    _, engine = fake_engine(monkeypatch, spec, load_group="resident")
    result = run(engine, cell(spec, "B3", concurrency=1))
    assert result.cost_terms.exposed_fetch_seconds == 0.0


# -- item 4: speculative sequences keep their target KV in a private cache ---------------------------------------
def test_speculative_kv_counts_the_sessions_private_caches(monkeypatch, spec):
    _, engine = fake_engine(monkeypatch, spec)
    workload = spec.workload
    ours = run(engine, cell(spec, "OURS", 8, 1))
    assert ours.status is Status.OK, ours.warnings
    # Prompt plus most of the generated tokens, not the prompt's paged blocks (16 tokens' worth here).
    assert ours.kv_occupancy_bytes >= TOKEN_KV_BYTES * (workload.prompt_tokens + workload.max_new_tokens // 2)
    assert "private" in ours.engine["metric_sources"]["kv_occupancy_bytes"]
    assert ours.engine["paged_kv_prompt_only_peak_bytes"] > 0


def test_speculative_kv_that_cannot_be_read_is_labelled_prompt_only(monkeypatch, spec):
    _, engine = fake_engine(monkeypatch, spec, disable=("verify_scheduler",))
    b1 = run(engine, cell(spec, "B1", 8, 1))  # whole-request generate: the session is internal to the library
    assert b1.engine["configuration"]["serving_path"] == "spec_whole_request"
    assert any(w.startswith("kv_occupancy_bytes") and "prompt" in w for w in b1.warnings), b1.warnings


# -- item 5: only c = 1 works on a pre-#173 build --------------------------------------------------------------
def test_pre_173_build_is_detected_and_named(monkeypatch, spec):
    _, engine = fake_engine(monkeypatch, spec, disable=("persistent_sessions",))
    assert engine.describe()["serving_generation"] == "pre-#173"
    refused = run(engine, cell(spec, "OURS", 8, 3))
    assert refused.status is Status.REFUSED
    assert "pre-#173" in refused.reason and "speculative_sessions" in refused.reason
    assert refused.engine["serving_generation"] == "pre-#173"
    assert run(engine, cell(spec, "OURS", 8, 1)).status is Status.OK


def test_post_173_build_keeps_c_sessions_in_flight(monkeypatch, spec):
    _, engine = fake_engine(monkeypatch, spec)
    assert engine.describe()["serving_generation"] == "post-#173"
    result = run(engine, cell(spec, "OURS", 8, 3))
    assert result.engine["peak_speculative_sessions"] == 3


# -- item 6: a standard step that runs the batch through the model more than once -------------------------------
def test_standard_step_that_reexecutes_the_batch_is_flagged(monkeypatch, spec):
    _, engine = fake_engine(monkeypatch, spec, faults=("standard_step_reexecutes",))
    result = run(engine, cell(spec, "B0", concurrency=3))
    forwards = result.engine["model_runner"]
    assert forwards["rows_per_emitted_token"] == pytest.approx(3.0)
    assert any("model_runner" in w and "more than once" in w for w in result.warnings), result.warnings


def test_standard_step_that_runs_once_is_not_flagged(monkeypatch, spec):
    _, engine = fake_engine(monkeypatch, spec)
    result = run(engine, cell(spec, "B0", concurrency=3))
    assert result.engine["model_runner"]["rows_per_emitted_token"] == pytest.approx(1.0)
    assert not [w for w in result.warnings if "model_runner" in w]


# -- item 7: MOE_ENABLE_SM120 is build-time only; MOE_PREFETCH_ISSUE_MODE is read by no library code ------------
def test_phase_a_spec_sets_no_variable_without_a_run_time_effect():
    data = yaml.safe_load((REPO / "jobs" / "phase_a.yaml").read_text())
    assert not {"MOE_ENABLE_SM120", "MOE_ENABLE_SM90", "MOE_PREFETCH_ISSUE_MODE"} & set(parse_spec(data).env)


def test_build_time_and_unread_variables_are_flagged(monkeypatch, spec):
    monkeypatch.setenv("MOE_ENABLE_SM120", "1")
    monkeypatch.setenv("MOE_PREFETCH_ISSUE_MODE", "cpp-batched")
    _, engine = fake_engine(monkeypatch, spec)
    facts = engine.describe()
    assert "MOE_ENABLE_SM120" not in facts["import_environment"]
    assert set(facts["ineffective_environment"]) == {"MOE_ENABLE_SM120", "MOE_PREFETCH_ISSUE_MODE"}
    result = run(engine, cell(spec, "B0", concurrency=1))
    assert any(w.startswith("MOE_ENABLE_SM120") and "build time" in w for w in result.warnings), (
        result.warnings
    )
    assert any(
        w.startswith("MOE_PREFETCH_ISSUE_MODE") and "no MoE-Infinity code" in w for w in result.warnings
    )


# -- issue 12: trust_remote_code off unless the spec turns it on; B3 rows carry no prediction counts ------------
@pytest.mark.parametrize("trust", [None, True])
def test_tokenizer_trusts_remote_code_only_when_the_spec_says_so(monkeypatch, tmp_path, tokenizer_dir, trust):
    from transformers import AutoTokenizer

    options = {} if trust is None else {"trust_remote_code": trust}
    spec = make_spec(tmp_path, tokenizer_dir, engine_options=options, **SMALL)
    original, seen = AutoTokenizer.from_pretrained, []

    def spy(*args, **kwargs):  # the real loader, with its arguments recorded
        seen.append(kwargs.get("trust_remote_code"))
        return original(*args, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", spy)
    fake_engine(monkeypatch, spec)
    assert seen == [bool(trust)]


@pytest.mark.parametrize("baseline", ["B0", "B3"])
def test_rows_without_route_ahead_carry_no_route_ahead_counts(monkeypatch, spec, baseline):
    """B0 (AR) and B3 (speculative, every expert resident) prefetch nothing by route-ahead: no counts (issue 12).
    B3's verify seam is observed only to show that nothing was predicted there."""
    _, engine = fake_engine(monkeypatch, spec, load_group="resident" if baseline == "B3" else "shared")
    measured = cell(spec, baseline, concurrency=1)
    row = Row.from_result(measured, run(engine, measured))
    assert row.status is Status.PARTIAL, row.reason
    assert row.route_ahead is None and row.route_ahead_prefetch_coverage is None
    assert row.cost_terms.route_ahead_coverage is None
    if baseline == "B0":
        assert "route_ahead_observer" not in row.engine and "route_ahead_bindings" not in row.engine
    else:  # speculative: route-ahead switched off at its seam, which then saw no prediction
        assert row.engine["route_ahead_observer"]["predicted_experts"] == 0


def test_byte_counts_are_integers(monkeypatch, spec):
    _, engine = fake_engine(monkeypatch, spec)
    result = run(engine, cell(spec, "OURS", 8, 1))
    assert isinstance(result.cost_terms.wasted_prefetch_bytes, int)
    assert all(isinstance(result.route_ahead[k], int) for k in result.route_ahead if k.endswith("_bytes"))
    assert isinstance(result.engine["paged_kv_prompt_only_peak_bytes"], int)


def test_fake_knobs_are_checked(monkeypatch):
    with pytest.raises(ValueError, match="unknown fake moe_infinity knobs"):
        import_fake(monkeypatch, disable=("no_such_part",))
