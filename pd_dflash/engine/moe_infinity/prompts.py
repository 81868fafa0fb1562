"""Prompt token ids for a cell: a fixed natural-language set ("synthetic") or a prompt file.

Upstream ran one fixed prompt for every request (its per-cell ``measure_configuration``). Real target/drafter pairs
need natural text for realistic acceptance, so "synthetic" here is a fixed set of technical paragraphs, the
first one upstream's prompt, tokenized once and cut into deterministic windows of ``prompt_tokens`` tokens
(request i starts at a seed-dependent offset), so every request differs and every run repeats. The seed is the
cell's repeat sample (``Cell.sample_seed``): every configuration of a repeat gets the same prompts, each repeat
others (a prompt file is read in its order for repeat 0 and in a seeded permutation of it for the others).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from pd_dflash.errors import InputError
from pd_dflash.spec import Workload

UPSTREAM_PROMPT = (
    "Explain in one paragraph why offloaded mixture-of-experts serving benefits from speculative decoding."
)
SYNTHETIC_TEXTS = (
    UPSTREAM_PROMPT,
    "Describe how a paged key-value cache allocates blocks to sequences of different lengths and what "
    "happens when the pool runs out of free blocks.",
    "Compare prefetching the experts of the next layer with fetching them on demand, and explain when each "
    "strategy wastes bandwidth on the PCIe link.",
    "Write a short function that merges overlapping intervals and explain its running time.",
    "Summarize the trade-off between batch size and per-token latency when serving a large language model "
    "on a single GPU.",
    "Explain what the acceptance length of a speculative decoder measures and why a block drafter can "
    "propose several tokens in one forward pass.",
    "List the steps needed to profile host-to-device memory copies with a system-wide tracer and to "
    "attribute them to named code ranges.",
    "Why does a mixture-of-experts layer route each token to only a few experts, and how does that change "
    "the memory traffic of inference?",
)


def _encode(tokenizer: Any, text: str) -> list[int]:
    return [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]


def build_prompts(
    tokenizer: Any, workload: Workload, count: int, *, seed: int | None = None, salt: int = 0
) -> list[list[int]]:
    """``count`` prompts (token id lists) for the workload, drawn from ``seed`` (the cell's repeat sample,
    ``Cell.sample_seed``; default the spec's seed); ``salt`` separates warm-up from timed prompts."""
    seed = workload.seed if seed is None else seed
    if workload.prompts == "synthetic":
        corpus = [t for text in SYNTHETIC_TEXTS for t in _encode(tokenizer, text)]
        if not corpus:
            raise InputError("the tokenizer produced no tokens for the synthetic prompts", where="tokenizer")
        n = workload.prompt_tokens
        prompts = []
        for i in range(count):
            offset = (seed + salt * 104_729 + i * 7_919) % len(corpus)
            prompts.append([corpus[(offset + j) % len(corpus)] for j in range(n)])
        return prompts
    path = Path(workload.prompts)
    try:
        lines = [line.strip() for line in path.read_text().splitlines()]
    except OSError as exc:
        raise InputError(
            f"cannot read prompt file: {exc.strerror or exc}", where="workload.prompts"
        ) from None
    encoded = [_encode(tokenizer, line) for line in lines if line]
    encoded = [ids for ids in encoded if ids]
    if not encoded:
        raise InputError(f"prompt file {path} has no non-empty prompt", where="workload.prompts")
    # The file's order for the spec's own seed (repeat 0), a seeded permutation of it for another sample.
    order = list(range(len(encoded)))
    if seed != workload.seed:
        random.Random(seed).shuffle(order)
    return [encoded[order[(salt + i) % len(encoded)]] for i in range(count)]
