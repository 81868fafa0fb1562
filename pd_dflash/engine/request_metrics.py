"""Per-request metrics shared by every engine: TTFT, TPOT, end-to-end latency and goodput at the SLO.

Definitions follow vLLM's ``benchmarks/serve.py`` and are written once, here:

- TTFT = first token − admission (the request enters the batch);
- TPOT = (e2e − TTFT) / (tokens − 1), defined only for requests with more than one token (a one-token request
  has no inter-token time: it is left out of the TPOT distribution and passes a TPOT SLO);
- goodput = tokens of the requests that meet EVERY given SLO, per second of the timed window.

Engines describe each timed request as a :class:`RequestTiming`; nothing here needs torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pd_dflash.schema import LatencyStats
from pd_dflash.spec import SLO


@dataclass(frozen=True)
class RequestTiming:
    """When one request was admitted, got its first token and finished (seconds, one clock), and its tokens."""

    admitted: float
    first_token: float | None
    finished: float | None
    tokens: int

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.admitted

    @property
    def e2e(self) -> float | None:
        return None if self.finished is None else self.finished - self.admitted

    @property
    def tpot(self) -> float | None:
        if self.tokens < 2 or self.ttft is None or self.e2e is None:
            return None
        return (self.e2e - self.ttft) / (self.tokens - 1)


def meets_slo(timing: RequestTiming, slo: SLO) -> bool:
    """vLLM's goodput rule: a request counts only if it meets every SLO given (a missing TTFT fails)."""
    if slo.ttft_ms is not None and (timing.ttft is None or timing.ttft * 1e3 > slo.ttft_ms):
        return False
    tpot = timing.tpot
    return not (slo.tpot_ms is not None and tpot is not None and tpot * 1e3 > slo.tpot_ms)


def goodput(timings: Iterable[RequestTiming], slo: SLO, elapsed_seconds: float) -> float:
    """Tokens per second of the requests that meet every SLO (all of them when no SLO is given)."""
    if elapsed_seconds <= 0:
        raise ValueError(f"goodput needs a positive timed window, got {elapsed_seconds!r} s")
    return sum(t.tokens for t in timings if meets_slo(t, slo)) / elapsed_seconds


def latency_samples(timings: Sequence[RequestTiming]) -> dict[str, list[float]]:
    """TTFT, TPOT and e2e samples over the requests that have them (the row's ``latency`` distributions)."""
    return {
        "ttft_seconds": [t.ttft for t in timings if t.ttft is not None],
        "tpot_seconds": [t.tpot for t in timings if t.tpot is not None],
        "e2e_seconds": [t.e2e for t in timings if t.e2e is not None],
    }


def latency_stats(samples: dict[str, list[float]]) -> dict[str, LatencyStats]:
    """A distribution per non-empty sample list (an empty one is left out, never summarised as zeros)."""
    out = {}
    for name, values in samples.items():
        stats = LatencyStats.from_samples(values)
        if stats is not None:
            out[name] = stats
    return out
