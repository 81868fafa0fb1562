"""PNG plots of the matrix (``--plots``). matplotlib is imported only here, object-oriented on the Agg
canvas (no pyplot, no global backend switch), so a long-lived collector process leaks no figures."""

from __future__ import annotations

import hashlib
import io
import re

from pd_dflash.baselines import BY_NAME, CANDIDATE, ORDER, SPECULATIVE_BASE
from pd_dflash.report.aggregate import Matrix

TOKENS = "output_tokens_per_second"

_STYLE = {name: c.plot_style for name, c in BY_NAME.items()}
_COLOR = {name: c.plot_color for name, c in BY_NAME.items()}


def _slug(model: str) -> str:
    """A file-name stem unique per model id: ``/`` becomes ``_`` (``openai/gpt-oss-20b`` →
    ``openai_gpt-oss-20b``); an id with any other character outside ``[A-Za-z0-9._-]`` (``_`` included) gets a
    hash suffix after ``+``, a character the plain form never has, so ``a/b`` and ``a_b`` cannot collide."""
    if re.fullmatch(r"[A-Za-z0-9.\-/]{1,100}", model) and not model.startswith("."):
        return model.replace("/", "_")
    readable = re.sub(r"[^A-Za-z0-9._-]+", "_", model)[:80].strip("_.") or "model"
    return f"{readable}+{hashlib.sha256(model.encode()).hexdigest()[:12]}"


def _series(matrix: Matrix, model: str, column: str):
    """{(baseline, B): [(c, mean, half-width or 0)]} for one model."""
    out: dict[tuple[str, int], list[tuple[int, float, float]]] = {}
    for key, g in matrix.groups.items():
        if g.model != model:
            continue
        for b in g.by_baseline:
            s = matrix.stats.get((key, b), {}).get(column)
            if s is None:
                continue
            half = 0.0 if s["ci95_low"] is None else (s["ci95_high"] - s["ci95_low"]) / 2
            if _plottable(s["mean"], half):
                out.setdefault((b, g.block_size), []).append((g.concurrency, s["mean"], half))
    return {k: sorted(v) for k, v in out.items()}


#: matplotlib cannot place ticks on an axis near the float range: larger values are left out of the plots (the
#: matrices hold them).
PLOTTABLE = 1e300


def _plottable(*values: float) -> bool:
    return all(abs(v) <= PLOTTABLE for v in values)


def _concurrency_axis(ax, concs: list[int]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(concs, [str(c) for c in concs])
    ax.minorticks_off()


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()


def _tokens_per_second(matrix: Matrix, model: str, blocks: list[int], concs: list[int]):
    """Tokens/s vs concurrency, one panel per block size: the design's money plot."""
    from matplotlib.figure import Figure

    tps = _series(matrix, model, "output_tokens_per_second")
    fig = Figure(figsize=(5.5 * len(blocks), 4.2), layout="constrained")
    axes = fig.subplots(1, len(blocks), squeeze=False)[0]
    for ax, bsz in zip(axes, blocks, strict=True):
        for b in ORDER:
            pts = tps.get((b, bsz))
            if pts:
                cs, ys, hs = zip(*pts, strict=True)
                ax.errorbar(cs, ys, yerr=hs, fmt=_STYLE[b], color=_COLOR[b], label=b, capsize=3)
        _concurrency_axis(ax, concs)
        ax.set_xlabel("concurrency c (requests in flight)")
        ax.set_ylabel("output tokens/s")
        ax.set_title(f"B = {bsz}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{model}: tokens/s vs concurrency (mean ± 95% CI)")
    return fig


def _coverage_waste(matrix: Matrix, model: str, blocks: list[int], concs: list[int]):
    """Route-ahead coverage and waste ratio vs block size, one line per (baseline, c)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2), layout="constrained")
    ax_cov, ax_waste = fig.subplots(1, 2)
    for ax, column, label in (
        (ax_cov, "route_ahead_prefetch_coverage", "prefetch coverage"),
        (ax_waste, "route_ahead.waste_ratio", "waste ratio"),
    ):
        series = _series(matrix, model, column)
        for b, style in ((CANDIDATE, "-"), (SPECULATIVE_BASE, ":")):
            for c in concs:
                pts = [(bsz, m, h) for bsz in blocks for (cc, m, h) in series.get((b, bsz), []) if cc == c]
                if pts:
                    xs, ys, hs = zip(*pts, strict=True)
                    ax.errorbar(xs, ys, yerr=hs, fmt="o" + style, label=f"{b} c={c}", capsize=3)
        ax.set_xticks(blocks)
        ax.set_xlabel("block size B")
        ax.set_ylabel(label)
        ax.set_ylim(-0.02, 1.02)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, ncol=2)
    fig.suptitle(f"{model}: route-ahead coverage and waste vs block size (OURS solid, B1 dotted)")
    return fig


def _acceptance_length(matrix: Matrix, model: str, blocks: list[int], concs: list[int]):
    """Acceptance length vs concurrency for the speculative baselines (the largest B solid)."""
    from matplotlib.figure import Figure

    acc = _series(matrix, model, "acceptance_length_a")
    fig = Figure(figsize=(6, 4.2), layout="constrained")
    ax = fig.subplots()
    for b in ORDER:
        for j, bsz in enumerate(blocks):
            pts = acc.get((b, bsz))
            if pts and BY_NAME[b].speculative:
                cs, ys, hs = zip(*pts, strict=True)
                fmt = _STYLE[b][0] + ("-" if j == len(blocks) - 1 else "--")
                ax.errorbar(cs, ys, yerr=hs, fmt=fmt, color=_COLOR[b], label=f"{b} B={bsz}", capsize=3)
    _concurrency_axis(ax, concs)
    ax.set_xlabel("concurrency c")
    ax.set_ylabel("acceptance length τ (tokens/round)")
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.suptitle(f"{model}: acceptance length (AR = 1)")
    return fig


#: The plots of one model: file name suffix → the function drawing it.
PLOTS = {
    "tokens_per_second": _tokens_per_second,
    "coverage_waste": _coverage_waste,
    "acceptance_length": _acceptance_length,
}


def render_plots(matrix: Matrix) -> dict[str, bytes]:
    """``plots/<model>_<what>.png`` → PNG bytes for every model and every plot of :data:`PLOTS`."""
    files: dict[str, bytes] = {}
    for model in sorted({g.model for g in matrix.groups.values()}):
        groups = [g for g in matrix.groups.values() if g.model == model]
        blocks = sorted({g.block_size for g in groups})
        concs = sorted({g.concurrency for g in groups})
        slug = _slug(model)
        for what, draw in PLOTS.items():
            files[f"plots/{slug}_{what}.png"] = _png(draw(matrix, model, blocks, concs))
    files.update(ablation_plots(matrix))
    return files


def ours_over_b1(matrix: Matrix) -> dict[tuple[str, int, int], dict[float, list[tuple[float, float]]]]:
    """For groups whose rows carry both ablation axes: {(model, B, c): {link GB/s: [(cache fraction, mean
    OURS tokens/s / mean B1 tokens/s)]}} (groups missing OURS or B1 are left out)."""
    out: dict[tuple[str, int, int], dict[float, list[tuple[float, float]]]] = {}
    for key, g in matrix.groups.items():
        placed = next(iter(g.by_baseline.values()), [])
        ablation = placed[0].row.ablation if placed else None
        if not ablation or not {"expert_cache_fraction", "emulated_h2d_gbps"} <= set(ablation):
            continue
        ours, b1 = matrix.mean(key, CANDIDATE, TOKENS), matrix.mean(key, SPECULATIVE_BASE, TOKENS)
        if ours is None or not b1 or not _plottable(ours / b1):
            continue
        series = out.setdefault((placed[0].row.model, g.block_size, g.concurrency), {})
        series.setdefault(ablation["emulated_h2d_gbps"], []).append(
            (ablation["expert_cache_fraction"], ours / b1)
        )
    return {k: {link: sorted(pts) for link, pts in sorted(v.items())} for k, v in sorted(out.items())}


def ablation_plots(matrix: Matrix) -> dict[str, bytes]:
    """``plots/<model>_ablation_B{b}_c{c}.png``: OURS / B1 tokens/s against the cache fraction, one line per
    emulated link rate (the cache × link ablation, ``jobs/ablation_cache_link.yaml``)."""
    from matplotlib.figure import Figure

    files = {}
    for (model, bsz, c), lines in ours_over_b1(matrix).items():
        fig = Figure(figsize=(5.5, 4.2), layout="constrained")
        ax = fig.subplots()
        for link, pts in lines.items():
            xs, ys = zip(*pts, strict=True)
            ax.plot(xs, ys, "o-", label=f"link {link:g} GB/s")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xlabel("expert cache fraction (of all routed experts)")
        ax.set_ylabel("OURS / B1 output tokens/s")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        fig.suptitle(f"{model}: B = {bsz}, c = {c}")
        files[f"plots/{_slug(model)}_ablation_B{bsz}_c{c}.png"] = _png(fig)
    return files
