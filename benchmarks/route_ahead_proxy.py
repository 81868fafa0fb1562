"""Recall of candidate route-ahead proxies (docs/reference-engine.md "Route-ahead proxy"): for drafted blocks
after greedy target rollouts, each candidate hidden state goes through the target's post-attention norm and
router of every MoE layer, and the union of the predicted top-k is compared with what the verify forward really
routed. Prints, per preset and block size, each candidate's recall (overall and per MoE layer) and |P|/|A|.

    .venv/bin/python benchmarks/route_ahead_proxy.py --preset mini-gpt-oss --block-sizes 16

Not a sweep (it probes the target's routers on drafted blocks, outside any cell), so it stays a script; the
configurations themselves are measured by sweep specs (jobs/engine_spec.yaml).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("PD_DFLASH_CACHE", str(Path(__file__).resolve().parents[1] / ".cache" / "pd-dflash"))


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
    drafter, facts = load_drafter(preset, model, block_size=block_size)
    family = family_of(model.config)
    seqs = target_rollouts(model, torch.from_numpy(preset.language.sample(prompts, 24, seed=[5, 5])), 24)
    moe = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, family.router_attr)]
    counts: dict[tuple[str, int], list[int]] = {}
    with routing_probe(model, family, moe) as seen, torch.no_grad():
        for anchor_pos in (26, 32, 38):
            step = proxy_counts(model, drafter, family, moe, seqs[:, :anchor_pos], block_size, seen)
            for key, c in step.items():
                counts[key] = [a + b for a, b in zip(counts.get(key, [0, 0, 0]), c, strict=True)]
    out = {
        "preset": preset_name,
        "block_size": block_size,
        "drafter_tau": facts["card"]["tau"],
        "moe_layers": moe,
    }
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

    from pd_dflash.engine.reference.presets.drafter_training import target_features

    out = model(ids, output_hidden_states=True)
    features = target_features(out.hidden_states, drafter.config.target_layer_ids)
    anchor = out.logits[:, -1].argmax(-1)
    # the block after every position of ``ids`` as context (what the serving drafter KV would hold)
    n, t = ids.shape
    at = torch.full((n, 1), t, dtype=torch.long, device=ids.device)
    hidden = drafter.teacher_forced(features, anchor[:, None], at, block_size)[:, 0]
    block = torch.cat([anchor[:, None], drafter.logits(hidden[:, 1:]).argmax(-1)], 1)
    model(torch.cat([ids, block], 1))  # the verify: ``seen`` now holds what it routed
    embedded = model.model.embed_tokens(block)
    candidates = {
        "drafter hidden": hidden,
        "token embedding": embedded,
        "drafter hidden + embedding": hidden + embedded,
        "first-layer residual (exact attention)": seen["first"][:, -block_size:],
    }
    counts = {}
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
    p.add_argument("--block-sizes", type=int, nargs="+", default=[8, 16])
    p.add_argument("--proxy-prompts", type=int, default=64)
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()
    results = {"proxy": [measure_proxy(args.preset, b, args.proxy_prompts) for b in args.block_sizes]}
    for r in results["proxy"]:
        print(
            f"{r['preset']} B={r['block_size']} (drafter tau {r['drafter_tau']}), MoE layers {r['moe_layers']}"
        )
        for name, v in r["proxies"].items():
            print(
                f"  {name:40s} recall {v['recall']:.3f}  per layer {v['recall_per_layer']}  "
                f"|P|/|A| {v['predicted_over_actual']:.2f}"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
