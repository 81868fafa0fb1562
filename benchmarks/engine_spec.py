"""All five configurations (B0 B1 B2 B3 OURS) of the reference engine on a mini preset, CPU, emulated link.

Prints per (B, c): tokens/s and its ratio to B0, τ (committed tokens per verify round), the two coverages
(prediction recall and prefetched-in-time; AR prefetcher for B0-B3, route-ahead for OURS), wasted prefetch
bytes, the hit rate, the exposed-fetch fraction, experts moved per generated token, OURS / B1 tokens/s, then
whether the design's ordering B0 < B1 < OURS ≤ B3 holds in tokens/s. Everything runs through the Engine
interface, exactly as a runner does; configurations of one (B, c, repeat) run back to back (a shared machine's
load drifts over minutes) and the table shows medians over repeats. The defaults are the ``cpu_reference``
setting (jobs/cpu_reference.yaml: mini-gpt-oss, cache 25 %, 0.05 GB/s + 10 us, 8 requests, auto new tokens).

    .venv/bin/python benchmarks/engine_spec.py --concurrency 1 --repeats 2 --width-ablation
    .venv/bin/python benchmarks/engine_spec.py --measure-proxy --preset mini-qwen3-coder

``--width-ablation`` also runs OURS with the cost-aware verify width off (``OURS-full-width``).

``--measure-proxy`` measures the recall of candidate route-ahead proxies instead (docs/reference-engine.md
"Route-ahead proxy"): for drafted blocks after greedy target rollouts, each candidate hidden state goes through
the target's post-attention norm and router of every MoE layer, and the union of the predicted top-k is compared
with what the verify forward really routed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("PD_DFLASH_CACHE", str(Path(__file__).resolve().parents[1] / ".cache" / "pd-dflash"))

from engine_ar import engine_for  # this directory is on sys.path when run as a script

BASELINES = ("B0", "B1", "B2", "B3", "OURS")
FULL_WIDTH = "-full-width"


def summarize(row) -> dict:
    ec = row.engine["expert_cache"]
    return {
        "tokens_per_second": row.output_tokens_per_second,
        "tau": row.acceptance_length_a,
        "coverage": row.route_ahead_prefetch_coverage,
        "in_time_coverage": row.prefetched_in_time_coverage,
        "experts_moved_per_token": ec["experts_moved_per_token"],
        "wasted_prefetch_bytes": row.wasted_prefetch_bytes,
        "hit_rate": row.expert_cache_hit_rate,
        "exposed_fetch_fraction": ec["exposed_fetch_fraction"],
        "h2d_bytes_per_token": (row.cost_terms.h2d_bytes or 0) / max(1, row.generated_tokens),
        "per_round_latency_seconds": row.per_round_latency_seconds,
        "requests_per_forward": row.engine["batch"]["requests_per_forward_mean"],
        "t_draft_seconds": row.t_draft_seconds,
        "t_router_seconds": row.t_router_seconds,
        "t_verify_seconds": row.t_verify_seconds,
        "overlap_any_compute": (row.engine.get("overlap") or {})
        .get("overlap_fraction", {})
        .get("any_compute"),
        "hidden": row.hide_inequality.hidden if row.hide_inequality else None,
        "digest": row.engine["output_digest"],
        "max_new_tokens": row.max_new_tokens,
    }


def compare(args) -> dict:
    """Every configuration at every (B, c), repeats back to back; medians per (B, c) and the ordering check."""
    from pd_dflash.spec import expand

    spec = bench_spec(args)
    start = time.perf_counter()
    engines = {"": engine_for(spec)}
    load = time.perf_counter() - start
    if args.width_ablation:  # OURS again with every block verified whole: the cost-aware width off
        engines[FULL_WIDTH] = engine_for(bench_spec(args, verify_width="full"))
    results, drafter = run_cells(engines, expand(spec), args)
    facts = engines[""].describe()
    for engine in engines.values():
        engine.close()
    configs = [*BASELINES, *(["OURS" + FULL_WIDTH] if args.width_ablation else [])]
    table = [group_row(results, b, conc, configs) for b in args.block_sizes for conc in args.concurrency]
    return {
        "preset": args.preset,
        "engine_load_seconds": load,
        "expert_nbytes": facts["expert_nbytes"],
        "total_expert_bytes": facts["total_expert_bytes"],
        "cache_fraction": args.fraction,
        "emulated_h2d_gbps": args.gbps,
        "emulated_latency_us": args.latency_us,
        "threads": args.threads,
        "drafter": drafter,
        "workload": spec.workload.model_dump(),
        "repeats": args.repeats,
        "table": table,
    }


def bench_spec(args, **overrides):
    from pd_dflash.spec import parse_spec

    options = {
        "emulated_h2d_gbps": args.gbps,
        "emulated_latency_us": args.latency_us,
        "drafter": args.drafter,
        "route_ahead_history": not args.no_history,
    }
    for item in args.option:
        key, _, value = item.partition("=")
        options[key] = json.loads(value)
    options.update(overrides)
    return parse_spec(
        {
            "name": "engine-spec-bench",
            "models": [{"id": args.preset, "preset": args.preset, "engine_options": options}],
            "baselines": list(BASELINES),
            "block_sizes": args.block_sizes,
            "concurrency": args.concurrency,
            "repeats": args.repeats,
            "workload": {
                "requests": args.requests,
                "warmup_rounds": args.warmup,
                "max_new_tokens": args.max_new if args.max_new == "auto" else int(args.max_new),
                "prompt_tokens": args.prompt_tokens,
                "temperature": args.temperature,
                "seed": 1408,
            },
            "memory": {"expert_cache_fraction": args.fraction},
            "hardware": {"device": "cpu", "cpus_per_runner": args.threads},
        }
    )


def run_cells(engines: dict, cells, args) -> tuple[dict[tuple, list[dict]], dict | None]:
    """Summaries per (configuration, B, c), one per repeat, and the drafter's facts. B0 is block-independent:
    one cell per (c, repeat), shown in every B group. ``engines[FULL_WIDTH]``, when present, runs OURS again as
    the configuration ``OURS-full-width``."""
    from pd_dflash.schema import Row

    by_key = {(c.baseline, c.block_size, c.concurrency, c.repeat): c for c in cells}
    smallest = min(args.block_sizes)
    results: dict[tuple, list[dict]] = {}
    drafter = None
    runs = [(b, b, "") for b in BASELINES] + (
        [("OURS", "OURS" + FULL_WIDTH, FULL_WIDTH)] if FULL_WIDTH in engines else []
    )
    for rep in range(args.repeats):
        for b in args.block_sizes:
            for conc in args.concurrency:
                for baseline, name, which in runs:
                    if b != smallest and baseline == "B0":
                        results.setdefault((name, b, conc), []).append(results[(name, smallest, conc)][rep])
                        continue
                    cell = by_key[(baseline, b, conc, rep)]
                    t0 = time.perf_counter()
                    row = Row.from_result(cell, engines[which].run_cell(cell))
                    summary = {**summarize(row), "cell_seconds": time.perf_counter() - t0}
                    drafter = drafter or row.engine.get("drafter")
                    results.setdefault((name, b, conc), []).append(summary)
    return results, drafter


def median_summary(summaries: list[dict]) -> dict:
    """Per field: the median over repeats when every value is a number, else the first repeat's value."""

    def numeric(v) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    return {
        k: statistics.median(r[k] for r in summaries)
        if all(numeric(r[k]) for r in summaries)
        else summaries[0][k]
        for k in summaries[0]
    }


def group_row(results: dict[tuple, list[dict]], b: int, conc: int, configs=BASELINES) -> dict:
    """One (B, c) group: every configuration's medians, tokens/s over B0 and over B1, the design's ordering."""
    med = {name: median_summary(results[(name, b, conc)]) for name in configs}
    tps = {name: med[name]["tokens_per_second"] for name in configs}
    return {
        "block_size": b,
        "concurrency": conc,
        "configurations": med,
        "over_b0": {k: v / tps["B0"] for k, v in tps.items()},
        "ours_over_b1": tps["OURS"] / tps["B1"],
        "experts_moved_per_token_b1": med["B1"]["experts_moved_per_token"],
        "ordering_b0_lt_b1_lt_ours_le_b3": tps["B0"] < tps["B1"] < tps["OURS"] <= tps["B3"],
        "ordering_parts": {
            "B0<B1": tps["B0"] < tps["B1"],
            "B1<OURS": tps["B1"] < tps["OURS"],
            "OURS<=B3": tps["OURS"] <= tps["B3"],
        },
        # Configurations that generated the same number of tokens (B0's auto budget follows the largest B).
        "same_tokens": len(
            {med[x]["digest"] for x in configs if med[x]["max_new_tokens"] == med["B1"]["max_new_tokens"]}
        )
        == 1,
    }


def print_compare(cmp: dict) -> None:
    print(
        f"{cmp['preset']}: expert {cmp['expert_nbytes']} B, all experts {cmp['total_expert_bytes']} B, cache "
        f"{cmp['cache_fraction']:.0%}, emulated link {cmp['emulated_h2d_gbps']} GB/s + {cmp['emulated_latency_us']} us, "
        f"drafter {cmp['drafter']['kind']}, medians over {cmp['repeats']} repeat(s)"
    )
    header = (
        "  B  c  conf   tok/s  /B0    tau  recall  in-time  waste MB  hit    exposed  experts/tok  req/fwd"
    )
    for group in cmp["table"]:
        print(header)
        for baseline, r in group["configurations"].items():
            cov = "   -   " if r["coverage"] is None else f"{r['coverage']:6.3f}"
            cov += "    -   " if r["in_time_coverage"] is None else f"  {r['in_time_coverage']:6.3f}"
            print(
                f"{group['block_size']:3d} {group['concurrency']:2d}  {baseline:4s} {r['tokens_per_second']:7.1f} "
                f"{group['over_b0'][baseline]:5.2f} {r['tau']:5.2f}  {cov}  {(r['wasted_prefetch_bytes'] or 0) / 1e6:8.2f}"
                f"  {r['hit_rate']:5.3f}  {r['exposed_fetch_fraction']:7.3f}  {r['experts_moved_per_token']:11.2f}"
                f"  {r['requests_per_forward']:7.2f}"
            )
        parts = ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in group["ordering_parts"].items())
        print(f"  OURS / B1 tokens/s = {group['ours_over_b1']:.3f}")
        verdict = "HOLDS" if group["ordering_b0_lt_b1_lt_ours_le_b3"] else "does NOT hold"
        print(
            f"  ordering B0 < B1 < OURS <= B3 {verdict} ({parts}); same tokens in every configuration of the same output length: "
            f"{group['same_tokens']}"
        )


def measure_proxy(preset_name: str, block_size: int, prompts: int) -> dict:
    """Recall of candidate route-ahead proxies against the verify's routing (greedy drafts after greedy rollouts)."""
    import torch

    from pd_dflash.engine.reference.families import family_of
    from pd_dflash.engine.reference.presets.catalog import get_preset
    from pd_dflash.engine.reference.presets.drafter_training import target_rollouts
    from pd_dflash.engine.reference.presets.drafters import load_drafter
    from pd_dflash.engine.reference.presets.training import load_preset

    torch.set_num_threads(1)
    preset = get_preset(preset_name)
    model, _ = load_preset(preset)
    drafter, card = load_drafter(preset, model)
    family = family_of(model.config)
    seqs = target_rollouts(model, torch.from_numpy(preset.language.sample(prompts, 24, seed=[5, 5])), 24)
    moe = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, family.router_attr)]
    counts: dict[tuple[str, int], list[int]] = {}
    with routing_probe(model, family, moe) as seen, torch.no_grad():
        for anchor_pos in (26, 32, 38):
            step = proxy_counts(model, drafter, family, moe, seqs[:, :anchor_pos], block_size, seen)
            for key, c in step.items():
                counts[key] = [a + b for a, b in zip(counts.get(key, [0, 0, 0]), c, strict=True)]
    out = {"preset": preset_name, "block_size": block_size, "drafter_tau": card["tau"], "moe_layers": moe}
    return {**out, "proxies": proxy_recall(counts, moe)}


@contextmanager
def routing_probe(model, family, moe: list[int]) -> Iterator[dict]:
    """Records, at every forward, each MoE layer's routed expert ids (``routed``) and the first MoE layer's
    residual stream before its post-attention norm (``first``)."""
    seen: dict = {"routed": {}, "first": None}
    hooks = [
        getattr(model.model.layers[i].mlp, family.router_attr).register_forward_hook(
            lambda _m, _i, out, i=i: seen["routed"].__setitem__(i, out[2])
        )
        for i in moe
    ]
    hooks.append(
        model.model.layers[moe[0]].post_attention_layernorm.register_forward_pre_hook(
            lambda _m, args: seen.__setitem__("first", args[0])
        )
    )
    try:
        yield seen
    finally:
        for h in hooks:
            h.remove()


def proxy_counts(
    model, drafter, family, moe, ids, block_size: int, seen: dict
) -> dict[tuple[str, int], list]:
    """[Σ|P∩A|, Σ|A|, Σ|P|] per (candidate proxy, MoE layer) for the greedy block drafted after each prefix of
    ``ids`` [n, t], A being what the verify of that block routed."""
    import torch

    from pd_dflash.engine.reference.block_drafter import gather_features

    cfg = drafter.config
    out = model(ids, output_hidden_states=True)
    ctx = gather_features(out.hidden_states, cfg.target_layer_ids)[:, -cfg.context_len :]
    anchor = out.logits[:, -1].argmax(-1)
    hidden = drafter.hidden_states(anchor, ctx, block_size)
    block = torch.cat([anchor[:, None], drafter.logits(hidden[:, 1:]).argmax(-1)], 1)
    model(torch.cat([ids, block], 1))  # the verify: ``seen`` now holds what it routed
    embedded = model.model.embed_tokens(block)
    candidates = {
        "drafter hidden": hidden,
        "token embedding": embedded,
        "drafter hidden + embedding": hidden + embedded,
        "first-layer residual (exact attention)": seen["first"][:, -block_size:],
    }
    n, counts = ids.shape[0], {}
    for layer in moe:
        routed = seen["routed"][layer]
        actual = routed.view(n, -1, routed.shape[-1])[:, -block_size:]
        norm = model.model.layers[layer].post_attention_layernorm
        router = getattr(model.model.layers[layer].mlp, family.router_attr)
        for name, x in candidates.items():
            pred = router(norm(x).reshape(-1, x.shape[-1]))[2].view(n, block_size, -1)
            c = [0, 0, 0]
            for s in range(n):
                a, p = set(actual[s].flatten().tolist()), set(pred[s].flatten().tolist())
                c = [c[0] + len(p & a), c[1] + len(a), c[2] + len(p)]
            counts[(name, layer)] = c
    return counts


def proxy_recall(counts: dict[tuple[str, int], list[int]], moe: list[int]) -> dict[str, dict]:
    """Recall (overall and per layer) and |P|/|A| per candidate proxy."""
    out = {}
    for name in dict.fromkeys(n for n, _ in counts):
        per = [counts[(name, layer)] for layer in moe]
        out[name] = {
            "recall": sum(c[0] for c in per) / sum(c[1] for c in per),
            "recall_per_layer": [round(c[0] / c[1], 3) for c in per],
            "predicted_over_actual": sum(c[2] for c in per) / sum(c[1] for c in per),
        }
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="mini-gpt-oss")
    p.add_argument("--gbps", type=float, default=0.05, help="emulated host-to-device bandwidth, GB/s")
    p.add_argument("--latency-us", type=float, default=10.0)
    p.add_argument(
        "--fraction", type=float, default=0.25, help="expert cache capacity / all routed-expert bytes"
    )
    p.add_argument("--block-sizes", type=int, nargs="+", default=[8, 16])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--max-new", default="auto", help="new tokens per request, or auto = max(4B, 32)")
    p.add_argument(
        "--width-ablation", action="store_true", help="also run OURS with every block verified whole"
    )
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--drafter", choices=("dflash", "early_exit"), default="dflash")
    p.add_argument(
        "--no-history", action="store_true", help="OURS predicts from route-ahead alone (ablation)"
    )
    p.add_argument(
        "--option",
        action="append",
        default=[],
        help="extra engine option KEY=JSON (e.g. scheduler_budget_bytes=1e7)",
    )
    p.add_argument("--measure-proxy", action="store_true", help="measure route-ahead proxy recall instead")
    p.add_argument("--proxy-prompts", type=int, default=64)
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()
    if args.measure_proxy:
        results = {
            "proxy": [measure_proxy(args.preset, b, args.proxy_prompts) for b in args.block_sizes],
        }
        for r in results["proxy"]:
            print(
                f"{r['preset']} B={r['block_size']} (drafter tau {r['drafter_tau']}), MoE layers {r['moe_layers']}"
            )
            for name, v in r["proxies"].items():
                print(
                    f"  {name:40s} recall {v['recall']:.3f}  per layer {v['recall_per_layer']}  "
                    f"|P|/|A| {v['predicted_over_actual']:.2f}"
                )
    else:
        results = compare(args)
        print_compare(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
