"""The toy language and routing the fake model, drafter and expert cache share (deterministic, no torch)."""

from __future__ import annotations

import time

VOCAB = 512
LAYERS = 4
EXPERTS = 16
TOP_K = 2
HIDDEN = 32
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 8
EXPERT_NBYTES = 1_000_000
DRAFT_BLOCK_SIZE = 16
#: Simulated link for the exposed-fetch counter (bytes/s) and the time of one forward / one draft pass.
LINK_BYTES_PER_SECOND = 50e9
FORWARD_SECONDS = 0.0003
DRAFT_SECONDS = 0.0001


def _mix(x: int) -> int:
    x = (x ^ (x >> 16)) * 0x45D9F3B % 2**32
    return (x ^ (x >> 16)) % 2**32


def next_token(context: list[int]) -> int:
    """The target's greedy continuation: a hash of the last three tokens and the length, never 0 or EOS."""
    a, b, c = ([0, 0, 0, *context])[-3:]
    return 1 + _mix(a * 7919 + b * 104729 + c * 31 + len(context)) % (VOCAB - 2)


def draft_agrees(position: int) -> bool:
    """Whether the drafter proposes the target's token at this absolute position (about 80% of positions)."""
    return _mix(position * 2_654_435_761 + 12_345) % 5 != 0


def route(token: int, layer: int) -> tuple[int, ...]:
    first = _mix(token * 31 + layer * 7) % EXPERTS
    second = (first + 1 + _mix(token + layer * 1_000_003) % (EXPERTS - 1)) % EXPERTS
    return (first, second)[:TOP_K]


def forward_pause(seconds: float = FORWARD_SECONDS) -> None:
    time.sleep(seconds)
