"""The stopping rule of adaptive repeats: when a group has measured enough (docs/metrics.md §7f). Pure: no torch,
no Ray.

Looking at a group after every repeat and stopping once its gates are decided inflates the error rate of a fixed-n
95 % interval: every look is one more chance for noise to decide a gate. The rule here is **Bonferroni
alpha-spending over the planned looks**. With ``repeats: {min, max}`` a group is looked at after min, min + 1, …,
max repeats: at most L = max − min + 1 looks, planned before anything is measured. Every look asks the verdict
gates of intervals of coverage 1 − α/L instead of 1 − α. By the union bound, the chance that *any* look decides a
gate wrongly (an interval wholly on the wrong side of the truth) is at most L · α/L = α, whichever look the group
stops at and however the stopping depends on the data.

It assumes what the fixed-n intervals assume (§7b): a group's repeats of one (baseline, metric) are independent
draws of one distribution, near enough to normal for a Student-t interval; repeats are independent because each
draws its own prompts and seeds from the spec seed and its index (issue 29). The level holds per gate of a group;
it is not corrected across the gates and groups of a matrix (neither is the fixed-n verdict).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

#: The error rate the rule holds per gate over all of a group's looks (the fixed-n intervals' 1 − 0.95).
ALPHA = 0.05
RULE = "Bonferroni alpha-spending over the planned looks"
INCONCLUSIVE = "INCONCLUSIVE"
#: Why a group stopped adding repeats.
DECIDED, MAX_REACHED, CELL_FAILURES = "decided", "max reached", "cell failures"
STOP_REASONS = (DECIDED, MAX_REACHED, CELL_FAILURES)
#: The most repeats an adaptive spec may plan (its ``max``): the plan and ``max_cells`` bound the cost by it.
MAX_ADAPTIVE_REPEATS = 32


class AdaptiveRepeats(BaseModel):
    """``repeats: {min, max, until: decided}`` of a spec: every group runs ``min`` repeats, then one more at a time
    while a verdict gate is INCONCLUSIVE under this rule, never more than ``max``. Strict like every spec input."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    min: Annotated[int, Field(ge=2, le=MAX_ADAPTIVE_REPEATS)]
    max: Annotated[int, Field(ge=2, le=MAX_ADAPTIVE_REPEATS)]
    #: What ends a group early; ``decided`` (no verdict gate INCONCLUSIVE) is the only rule.
    until: Literal["decided"] = "decided"

    @model_validator(mode="after")
    def _ordered(self) -> AdaptiveRepeats:
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) must not exceed max ({self.max})")
        return self


def _repeats_kind(value: Any) -> str:
    return "adaptive" if isinstance(value, (dict, AdaptiveRepeats)) else "fixed"


#: A spec's ``repeats``: ``N`` (fixed) or ``{min, max, until}`` (adaptive); an error names the form it read.
Repeats = Annotated[
    Annotated[Annotated[int, Field(ge=1)], Tag("fixed")] | Annotated[AdaptiveRepeats, Tag("adaptive")],
    Discriminator(_repeats_kind),
]


def repeat_bounds(repeats: int | AdaptiveRepeats) -> tuple[int, int]:
    """(the repeats every group runs, the most any runs): (N, N) for a fixed count, (min, max) adaptive."""
    return (repeats.min, repeats.max) if isinstance(repeats, AdaptiveRepeats) else (repeats, repeats)


def planned_looks(bounds: AdaptiveRepeats) -> int:
    """L = max − min + 1: a look after each repeat from min to max."""
    return bounds.max - bounds.min + 1


def look_coverage(bounds: AdaptiveRepeats, alpha: float = ALPHA) -> float:
    """The coverage of every look's intervals, 1 − α/L (0.9833… for min 2, max 4)."""
    return 1.0 - alpha / planned_looks(bounds)


def stop_reason(
    statuses: Iterable[str], repeats: int, bounds: AdaptiveRepeats, *, failed: bool
) -> str | None:
    """Why a group stops after a look at ``repeats`` repeats, or None: it needs one more.

    ``statuses`` are its verdict gates on this look's intervals; ``failed`` says a cell it needs has no measured
    row (ERROR, TIMEOUT, a refusal, a PARTIAL row lacking a metric): more repeats cannot complete the group.
    """
    if failed:
        return CELL_FAILURES
    if INCONCLUSIVE not in set(statuses):
        return DECIDED
    if repeats >= bounds.max:
        return MAX_REACHED
    return None
