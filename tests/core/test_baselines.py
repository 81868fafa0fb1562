"""The configuration table (``pd_dflash/baselines.py``): every reader agrees with it, and the docs' copy is its."""

from __future__ import annotations

from pathlib import Path

import pytest

from pd_dflash.baselines import (
    BLOCK_INDEPENDENT,
    BY_NAME,
    CONFIGURATIONS,
    GATED,
    OFFLOADED,
    ORDER,
    configuration,
)
from pd_dflash.spec import expand, parse_spec
from pd_dflash.upstream import BASELINE_DESCRIPTIONS, UPSTREAM_BASELINES

DOC = Path(__file__).resolve().parents[2] / "docs" / "reference-engine.md"


def doc_row(c) -> str:
    prefetcher = c.prefetcher + ("" if c.offloaded else " (observe-only)")
    experts = "offloaded" if c.offloaded else "resident"
    gates = "yes" if c.gated else "no (ablation)"
    return f"| **{c.name}** | {c.decoding} | {prefetcher} | {c.admission} | {experts} | {gates} |"


def test_the_docs_table_is_the_code_table():
    lines = DOC.read_text().splitlines()
    start = lines.index("| configuration | decoding | prefetcher | admission | experts | Phase-A gates |")
    documented = lines[start + 2 : start + 2 + len(CONFIGURATIONS) + 1]
    assert documented[: len(CONFIGURATIONS)] == [doc_row(c) for c in CONFIGURATIONS]
    assert not documented[len(CONFIGURATIONS)].startswith("|"), (
        "the docs list a configuration the code has not"
    )


def test_upstream_configurations_keep_upstream_words_and_meaning():
    assert ORDER[: len(UPSTREAM_BASELINES)] == UPSTREAM_BASELINES
    for name in (*UPSTREAM_BASELINES, "OURS"):
        assert BY_NAME[name].description == BASELINE_DESCRIPTIONS[name]
        assert BY_NAME[name].gated
    assert {"B0"} == BLOCK_INDEPENDENT
    assert {c.name for c in CONFIGURATIONS} - {"B3"} == OFFLOADED
    assert configuration("OURS").route_ahead and configuration("OURS").admission == "two_dim_deficit"
    assert configuration("B2").admission == "token_deficit" and not configuration("B2").route_ahead
    assert set(GATED) >= {"B0", "B1", "B2", "B3", "OURS"}


def test_an_unknown_configuration_is_named():
    with pytest.raises(KeyError, match="unknown configuration 'B9'"):
        configuration("B9")


@pytest.mark.parametrize("name", ORDER)
def test_every_configuration_expands_as_its_entry_says(name):
    spec = parse_spec(
        {
            "name": "t",
            "engine": "reference",
            "models": [{"id": "micro", "preset": "micro"}],
            "baselines": [name],
            "block_sizes": [8, 16],
            "concurrency": [1],
            "repeats": 1,
            "memory": {"expert_cache_fraction": 0.5},
        }
    )
    cells = expand(spec)
    c = configuration(name)
    assert len(cells) == (1 if c.block_independent else 2)
    assert all(cell.offloaded == c.offloaded and cell.speculative == c.speculative for cell in cells)


def test_moe_infinity_refuses_the_reference_ablations_at_plan():
    """RA and AR2D recombine the reference engine's own parts: the MoE-Infinity adapter would run another
    configuration under their name, so the plan blocks them with the reason."""
    from pd_dflash.engine.registry import blocked_reason

    spec = parse_spec(
        {
            "name": "t",
            "engine": "moe_infinity",
            "models": [{"id": "m", "offload_dir": "/tmp/off"}],
            "baselines": ["B1", "RA", "AR2D"],
            "block_sizes": [8],
            "concurrency": [1],
            "repeats": 1,
        }
    )
    reasons = {c.baseline: blocked_reason("moe_infinity", c) for c in expand(spec)}
    assert reasons["B1"] is None
    assert "ablation of the reference engine" in reasons["RA"] and "AR2D" in reasons["AR2D"]


PACKAGE = Path(__file__).resolve().parents[2] / "pd_dflash"
#: Where a configuration may be named: the table, upstream's words, and at most one more module.
NAMING_MODULES = {"baselines.py", "upstream.py"}


def _naming_modules() -> dict[str, list[str]]:
    """Modules of the package holding a string constant that is a configuration's name (e.g. ``"OURS"``)."""
    import ast

    names = set(ORDER)
    found: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and node.value in names:
                found.setdefault(path.relative_to(PACKAGE).as_posix(), []).append(
                    f"{node.value}:{node.lineno}"
                )
    return found


def test_configurations_are_named_only_by_the_table_upstream_and_one_more_module():
    """The gates read roles (base, candidate, resident bound, ordering chain) from the table; a module that
    compares against ``"OURS"`` or ``"B0"`` itself is a second source of truth."""
    found = _naming_modules()
    assert set(found) >= NAMING_MODULES  # the check can see names where they are
    others = {m: v for m, v in found.items() if m not in NAMING_MODULES}
    assert len(others) <= 1, f"configuration names outside baselines.py and upstream.py: {others}"


def test_the_roles_are_the_designs():
    from pd_dflash.baselines import (
        BASE,
        CANDIDATE,
        ORDERING_CHAIN,
        RESIDENT_BOUND,
        SPECULATIVE_BASE,
        ordering_step_loose,
    )

    assert (BASE, CANDIDATE, RESIDENT_BOUND, SPECULATIVE_BASE) == ("B0", "OURS", "B3", "B1")
    assert ORDERING_CHAIN == ("B0", "B1", "OURS", "B3")
    assert ordering_step_loose("OURS", "B3") and not ordering_step_loose("B1", "B3")
    assert not configuration(RESIDENT_BOUND).offloaded and configuration(CANDIDATE).route_ahead
    assert configuration(BASE).block_independent and not configuration(SPECULATIVE_BASE).route_ahead
