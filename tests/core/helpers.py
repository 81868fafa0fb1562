"""Builders shared by the pure-core tests (docs/testing.md lists where every shared test helper lives).

- The hand-built gate group (model m, B=8, c=1) whose rows pass every gate: ``gate_spec``, ``result``,
  ``rows_of``; each gate test moves one input of it.
- Upstream-format rows (the canonical gpt-oss OURS row of upstream's design, B=16, c=1) and a synthetic Phase-A
  grid over ``expand(jobs/phase_a.yaml)`` with made-up but internally consistent numbers.
- Small spec data for the spec, ablation and bad-input tests.

Every row here is synthetic test data; nothing is a measurement.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

from pd_dflash.costmodel import evaluate_hide_inequality
from pd_dflash.schema import EngineResult, Row, parse_row
from pd_dflash.spec import expand, load_spec, parse_spec

REPO = Path(__file__).resolve().parents[2]
PHASE_A = REPO / "jobs" / "phase_a.yaml"
GPTOSS = "openai/gpt-oss-20b"


# -- the hand-built gate group ---------------------------------------------------------------------------------
KEY = "m|B8|c1"
ALL = ("B0", "B1", "B3", "OURS")
TOKENS = {"B0": 20.0, "B1": 30.0, "OURS": 45.0, "B3": 70.0}
# A hide inequality that holds: (1 - 0.5) * 1 * 8 / 4 = 1.0 s to fetch, 0.5 + 0.25 + 0.5 = 1.25 s of window.
HIDE = dict(
    resident_fraction=0.5,
    saturation=1.0,
    total_expert_bytes=8.0,
    measured_h2d_bytes_per_second=4.0,
    draft_seconds=0.5,
    router_seconds=0.25,
    overlap_seconds=0.5,
)


def gate_spec(repeats: int = 1, baselines=ALL, models=("m",), block_sizes=(8,)):
    """The group's spec: models ``m`` at B=8, c=1, every Phase-A baseline but B2 (narrowed or widened by the
    arguments)."""
    return parse_spec(
        {
            "name": "gates",
            "engine": "reference",
            "models": [{"id": m, "preset": "micro", "draft": "micro-dflash"} for m in models],
            "baselines": list(baselines),
            "block_sizes": list(block_sizes),
            "concurrency": [1],
            "repeats": repeats,
        }
    )


def result(baseline: str, repeat: int, **over) -> EngineResult:
    """A measured row that passes every gate; ``over`` replaces fields (a callable gets the repeat index)."""
    speculative = baseline in ("B1", "B2", "OURS")
    tokens = TOKENS.get(baseline, 33.0)  # B2 is not in the ordering chain
    data = {
        "output_tokens_per_second": tokens,
        "acceptance_length_a": 3.0 if speculative else 1.0,
        "ttft_seconds": 0.25,
        "per_round_latency_seconds": 0.0625,
        "goodput_at_slo": tokens,
        "expert_cache_hit_rate": 0.75,
        "route_ahead_prefetch_coverage": 0.875,
        "wasted_prefetch_bytes": 1024,
        "expert_occupancy_bytes": 2**20,
        "kv_occupancy_bytes": 2**16,
    }
    if speculative:
        data.update(t_draft_seconds=0.5, t_router_seconds=0.125, t_verify_seconds=1.0)
    if baseline == "OURS":
        data["route_ahead"] = {
            "predicted_experts": 100,
            "actual_experts": 80,
            "covered_experts": 70,
            "coverage": 0.875,
            "waste_ratio": 0.25,
        }
        data["hide_inequality"] = evaluate_hide_inequality(**HIDE)
    data.update({k: v(repeat) if callable(v) else v for k, v in over.items()})
    return EngineResult(**data)


#: A per-repeat wobble (as a fraction) for ``jittered``: no interval of a few repeats has zero width.
JITTER = (-1.0, 1.0, 0.0, 0.5, -0.5, 0.8, -0.8, 0.2)


def jittered(baseline: str, repeat: int, **over) -> EngineResult:
    """``result`` with every number a gate reads moved by 1-2 % per repeat (``JITTER``): each gate still passes
    clearly, on intervals of real (non-zero) width. ``over`` replaces fields, as in ``result``."""
    j = JITTER[repeat % len(JITTER)]
    speculative = baseline in ("B1", "B2", "OURS")
    data = {"output_tokens_per_second": TOKENS.get(baseline, 33.0) * (1 + 0.01 * j)}
    if speculative:
        data.update(t_router_seconds=0.125 * (1 + 0.02 * j), t_verify_seconds=1.0 * (1 - 0.01 * j))
    if baseline == "OURS":
        ratio = 0.25 + 0.01 * j
        data["route_ahead"] = {**result("OURS", repeat).route_ahead, "waste_ratio": ratio}
        data["hide_inequality"] = evaluate_hide_inequality(
            **{**HIDE, "overlap_seconds": 0.5 * (1 + 0.01 * j)}
        )
    return result(baseline, repeat, **{**data, **over})


def rows_of(s, drop=(), status=None, **by_baseline) -> list[Row]:
    """A measured row per cell; ``status`` maps (baseline, repeat) to (status, reason) for rows without
    metrics; ``drop`` lists (baseline, repeat) left out."""
    out = []
    for c in expand(s):
        if (c.baseline, c.repeat) in drop:
            continue
        st = (status or {}).get((c.baseline, c.repeat))
        if st is not None:
            out.append(Row.without_metrics(c, st[0], st[1]))
            continue
        out.append(Row.from_result(c, result(c.baseline, c.repeat, **by_baseline.get(c.baseline, {}))))
    return out


# -- upstream-format rows -------------------------------------------------------------------------------------
CANONICAL_OURS = {
    "model": GPTOSS,
    "draft": "z-lab/gpt-oss-20b-DFlash",
    "baseline": "OURS",
    "block_size": 16,
    "concurrency": 1,
    "repeat": 0,
    "output_tokens_per_second": 64.97956088942549,
    "acceptance_length_a": 1.0,
    "ttft_seconds": 0.29489212902262807,
    "per_round_latency_seconds": 0.015389454565593041,
    "goodput_at_slo": 64.97956088942549,
    "expert_cache_hit_rate": 0.7637693631669535,
    "route_ahead_prefetch_coverage": 1.0,
    "wasted_prefetch_bytes": 0.0,
    "expert_occupancy_bytes": 18246754304.0,
    "kv_occupancy_bytes": 0.0,
    "cost_terms": {
        "measured_h2d_bytes_per_second": 57553826518.35307,
        "route_ahead_coverage": 1.0,
        "wasted_prefetch_bytes": 0,
    },
    "warnings": ["kv_occupancy_bytes fell back to 0.0"],
}


def upstream(baseline: str, *, block: int = 16, conc: int = 1, tps: float = 50.0, **over) -> dict:
    """An upstream runner row (no status key, as upstream writes OK rows)."""
    row = {
        **CANONICAL_OURS,
        "baseline": baseline,
        "block_size": block,
        "concurrency": conc,
        "output_tokens_per_second": tps,
        "goodput_at_slo": tps,
    }
    if baseline == "B0":
        row["draft"] = ""
    row.update(over)
    return row


def upstream_blocked_b2(*, block: int = 16, conc: int = 1) -> dict:
    """Upstream's B2 row as it writes it while the 2-D scheduler is missing: identity and status only."""
    keep = ("model", "draft", "baseline", "block_size", "concurrency", "repeat")
    row = {k: v for k, v in upstream("B2", block=block, conc=conc).items() if k in keep}
    return {**row, "status": "BLOCKED_UNTIL_2D_SCHEDULER"}


def upstream_group(block: int = 16, conc: int = 1) -> list[dict]:
    """One upstream group (B0, B1, a blocked B2, B3) at one block size and concurrency."""
    return [
        upstream("B0", block=block, conc=conc, tps=20.0),
        upstream("B1", block=block, conc=conc, tps=40.0),
        upstream_blocked_b2(block=block, conc=conc),
        upstream("B3", block=block, conc=conc, tps=90.0),
    ]


def ours_row(repeat: int) -> Row:
    """Upstream's canonical OURS row at ``repeat``, parsed as ``pd-dflash report`` reads it."""
    return parse_row(upstream("OURS", repeat=repeat), where="test")


# -- a synthetic Phase-A grid ---------------------------------------------------------------------------------
#: The hide inequality's terms at upstream's anchor (hidden: 0.5 * 14e9 / 50e9 = 0.14 s < 0.15 s of window).
ANCHOR = dict(
    resident_fraction=0.5,
    saturation=1.0,
    total_expert_bytes=14e9,
    measured_h2d_bytes_per_second=50e9,
    draft_seconds=0.04,
    router_seconds=0.01,
    overlap_seconds=0.10,
)

BASE_TPS = {"B0": 20.0, "B1": 30.0, "B2": 33.0, "OURS": 45.0, "B3": 70.0}


def synth_result(cell, rng: random.Random, **over) -> EngineResult:
    """Made-up but internally consistent numbers for one cell (ordering B0 < B1 < OURS <= B3 holds)."""
    spec_dec = cell.baseline in ("B1", "B2", "OURS")
    tps = BASE_TPS[cell.baseline] * math.sqrt(cell.concurrency) * rng.uniform(0.97, 1.03)
    acc = min(cell.block_size, 3.0 + cell.block_size / 8 + rng.uniform(-0.2, 0.2)) if spec_dec else 1.0
    coverage = {"B0": 0.4, "B1": 0.5, "B2": 0.5, "B3": 1.0, "OURS": 0.9}[cell.baseline] + rng.uniform(
        -0.02, 0.02
    )
    data = {
        "output_tokens_per_second": tps,
        "acceptance_length_a": acc,
        "ttft_seconds": 0.2 * rng.uniform(0.9, 1.1),
        "per_round_latency_seconds": 0.015 * rng.uniform(0.9, 1.1),
        "goodput_at_slo": tps,
        "expert_cache_hit_rate": 0.75,
        "route_ahead_prefetch_coverage": min(1.0, coverage),
        "wasted_prefetch_bytes": 1e8 * rng.uniform(0.5, 1.5),
        "expert_occupancy_bytes": 1.8e10,
        "kv_occupancy_bytes": 6.5e7,
    }
    if spec_dec:
        data["t_draft_seconds"] = 0.04
        data["t_router_seconds"] = 0.002 * rng.uniform(0.9, 1.1)
        data["t_verify_seconds"] = 0.02
        predicted = 1000
        data["route_ahead"] = {
            "steps": 10,
            "layers_observed": 240,
            "predicted_experts": predicted,
            "actual_experts": 900,
            "covered_experts": int(900 * coverage),
            "kept_experts": 800,
            "wasted_experts": 200,
            "coverage": min(1.0, coverage),
            "waste_ratio": 0.2 + rng.uniform(-0.02, 0.02),
        }
    if cell.baseline == "OURS":
        overlap = ANCHOR["overlap_seconds"] * rng.uniform(0.99, 1.01)
        data["hide_inequality"] = evaluate_hide_inequality(**{**ANCHOR, "overlap_seconds": overlap})
    data.update(over)
    return EngineResult(**data)


def synth_rows(baselines=None, repeats=None, seed: int = 1408, tweak=None) -> list[Row]:
    """A row per cell of jobs/phase_a.yaml (optionally only these baselines / repeats; by default its first
    ``min`` = 3 repeats, of an adaptive 3-6), seeded; ``tweak(cell)`` gives the fields that cell's result replaces."""
    rng = random.Random(seed)
    rows = []
    spec = load_spec(PHASE_A)
    repeats = range(spec.min_repeats) if repeats is None else repeats
    for cell in expand(spec):
        if (baselines and cell.baseline not in baselines) or cell.repeat not in repeats:
            continue
        over = tweak(cell) if tweak else {}
        rows.append(Row.from_result(cell, synth_result(cell, rng, **over)))
    return rows


# -- spec data -------------------------------------------------------------------------------------------------
def base_spec(**over):
    """The data of a small micro spec: all five baselines, B=8 and 16, c=1 and 4, two repeats."""
    data = {
        "name": "t",
        "engine": "reference",
        "models": [{"id": "micro", "preset": "micro", "draft": "micro-dflash"}],
        "baselines": ["B0", "B1", "B2", "B3", "OURS"],
        "block_sizes": [8, 16],
        "concurrency": [1, 4],
        "repeats": 2,
    }
    data.update(over)
    return data


def spec_data(**over) -> dict:
    """The data of the bad-input tests' micro spec: B0, B1 and OURS, B=8, c=1 and 4, two repeats."""
    data = {
        "name": "t",
        "engine": "reference",
        "models": [{"id": "micro", "preset": "micro", "draft": "micro-dflash"}],
        "baselines": ["B0", "B1", "OURS"],
        "block_sizes": [8],
        "concurrency": [1, 4],
        "repeats": 2,
    }
    data.update(over)
    return data


LINKS = [0.03, 0.05, 0.1]


def ablation_spec(**over):
    """B1 and OURS over two cache fractions x the three ``LINKS`` rates (list-valued ablation axes)."""
    data = base_spec(
        baselines=["B1", "OURS"],
        block_sizes=[8],
        concurrency=[1],
        repeats=1,
        memory={"expert_cache_fraction": [0.25, 0.5]},
    )
    data["models"] = [{**data["models"][0], "engine_options": {"emulated_h2d_gbps": LINKS}}]
    data.update(over)
    return parse_spec(data)
