"""Cost-aware verify width (OURS, ``engine_options.verify_width: cost_aware``): verify a prefix of the drafted
block when the next position costs more link time than it is expected to save.

Route-ahead knows, before the verify, which experts every row of the block will route. Row i (draft d_i) adds
the experts no earlier row needs and the cache neither holds nor is fetching: ``new_bytes_i``. Its expected gain
is one token if the first i drafts are all accepted, which happens with the measured probability
``p_i = P(accepted ≥ i)`` (the cell's own verify rounds so far), and a token is worth the measured seconds per
committed token. Its cost is the link time of those bytes when they are wasted: an accepted row's experts are
the ones the next round would fetch for the same tokens anyway, a rejected row's are not. Once the block needs
more distinct experts than the cache has slots, each new one also displaces an expert this round or the next
needs again, so it counts twice. The block is cut before the first row with

    (1 − p_i) · new_bytes_i / link_bytes_per_second  >  p_i · seconds_per_token

(later rows depend on row i being accepted, so they go too). Lossless: the verify of a prefix accepts a prefix of
the same drafts and its bonus token is the target's own next token, so the committed tokens are those greedy AR
decoding produces (T = 0), and speculative sampling keeps its distribution (T > 0). Until a verify round has been
measured no block is cut. Pure Python (no torch).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence


class CostAwareWidth:
    """The cut rule and the measurements it uses (acceptance per position, seconds per committed token)."""

    def __init__(self, link_bytes_per_second: float, smoothing: float = 0.2) -> None:
        if not link_bytes_per_second > 0:
            raise ValueError(f"link_bytes_per_second must be > 0, got {link_bytes_per_second!r}")
        self.link_bytes_per_second = float(link_bytes_per_second)
        self.smoothing = smoothing
        #: Per draft position i ≥ 1: [blocks that verified row i with drafts 1..i−1 accepted, of which d_i was
        #: accepted]. A cut block says nothing about the rows it did not verify (censored, not rejected).
        self.reached: Counter[int] = Counter()
        self.passed: Counter[int] = Counter()
        self.seconds_per_token: float | None = None
        self.blocks = self.blocks_cut = self.rows_cut = 0

    def observe(self, outcomes: Sequence[tuple[int, int]], seconds: float, committed: int) -> None:
        """One verify round: (accepted drafts, verified rows) per verified block, its wall time and committed
        tokens."""
        for accepted, rows in outcomes:
            for i in range(
                1, min(accepted + 1, rows - 1) + 1
            ):  # rows 1..accepted+1 were reached, if verified
                self.reached[i] += 1
                self.passed[i] += i <= accepted
        if committed > 0 and seconds > 0:
            spt = seconds / committed
            s = self.smoothing
            self.seconds_per_token = (
                spt if self.seconds_per_token is None else (1 - s) * self.seconds_per_token + s * spt
            )

    def survival(self, i: int) -> float | None:
        """P(accepted ≥ i): the product of the measured per-position acceptance of rows 1..i (Kaplan-Meier: a
        cut block counts only for the rows it verified); None before any measurement. A position never reached
        yet keeps the last measured position's rate."""
        if not self.reached:
            return None
        p, rate = 1.0, 1.0
        for j in range(1, i + 1):
            if self.reached[j]:
                rate = self.passed[j] / self.reached[j]
            p *= rate
        return p

    def width(self, new_bytes: Sequence[int], *, count: bool = True) -> int:
        """How many rows of a block to verify, given each row's new bytes: the anchor and the first draft always
        stay (a verify round proposes at least one draft). ``count=False``: a look-ahead (route-ahead's early
        issue), not a decision: the counters stay."""
        self.blocks += count
        if self.seconds_per_token is None or not self.reached:
            return len(new_bytes)
        for i in range(2, len(new_bytes)):
            p = self.survival(i)
            wasted = (1.0 - p) * new_bytes[i] / self.link_bytes_per_second
            if wasted > p * self.seconds_per_token:
                self.blocks_cut += count
                self.rows_cut += (len(new_bytes) - i) * count
                return i
        return len(new_bytes)

    def describe(self) -> dict:
        return {
            "rule": "cut before row i when (1 - p_i) * new_bytes_i / BW > p_i * seconds per token, "
            "p_i = P(accepted >= i)",
            "link_bytes_per_second": self.link_bytes_per_second,
            "blocks": self.blocks,
            "blocks_cut": self.blocks_cut,
            "rows_cut": self.rows_cut,
            "seconds_per_token": self.seconds_per_token,
            "survival": {str(i): self.survival(i) for i in sorted(self.reached)},
        }


def new_bytes_per_row(
    rows: Sequence[set], is_cached, expert_nbytes: int, slots: int | None = None
) -> list[int]:
    """Bytes each row adds: its (layer, expert) keys not needed by an earlier row and not cached or in flight.
    Once the rows so far need more distinct keys than the cache has ``slots``, a new key also displaces one the
    round (or the next) needs again: it counts twice."""
    seen: set = set()
    out = []
    for keys in rows:
        new = {k for k in keys if k not in seen and not is_cached(k)}
        seen |= keys
        factor = 2 if slots is not None and len(seen) > slots else 1
        out.append(factor * len(new) * expert_nbytes)
    return out
