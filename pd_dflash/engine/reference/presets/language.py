"""The synthetic language the reference presets are trained on, with an exactly known entropy floor.

Random-weight models route and accept meaninglessly; a tiny target trained on a language with structure gives
realistic acceptance and skewed, temporally correlated routing. The language:

- ``V = modes × mode_vocab`` tokens; token ``x`` belongs to mode ``x // mode_vocab`` (a "topic": code, prose...).
- A sequence starts in a uniformly random mode with two uniform tokens of that mode. Each later position
  first switches to a uniformly random *other* mode with probability ``switch_p`` (topics persist), then emits
  with probability ``rule_p`` the token ``rule[mode, x_{t-2} % S, x_{t-1} % S]`` (an order-2 grammar, one
  seeded table per mode), else a uniform token of the mode.

Because modes have disjoint vocabularies, the previous token reveals the mode, so the entropy rate for t ≥ 2 is
exactly ``h(switch_p) + switch_p·ln(modes−1) + H_tok`` with ``H_tok`` the entropy of the within-mode emission
(``entropy_floor_nats``). Trained models learn mode-specialised experts: routing is skewed per request and
correlated over time, like real MoE routing on a topic.
"""

from __future__ import annotations

import math
from typing import Annotated

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator


class SyntheticLanguage(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    modes: Annotated[int, Field(ge=1)] = 4
    mode_vocab: Annotated[int, Field(ge=2)] = 16
    rule_p: Annotated[float, Field(gt=0.0, lt=1.0)] = 0.85
    switch_p: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.02
    #: Seeds the rule tables (the language itself; sampling has its own seeds).
    seed: int = 0

    @model_validator(mode="after")
    def _check(self) -> SyntheticLanguage:
        if self.modes == 1 and self.switch_p > 0:
            raise ValueError("switch_p must be 0 with a single mode (there is no other mode to switch to)")
        return self

    @property
    def vocab_size(self) -> int:
        return self.modes * self.mode_vocab

    def rule_table(self) -> np.ndarray:
        rng = np.random.default_rng([self.seed, 0x5EED])
        return rng.integers(0, self.mode_vocab, size=(self.modes, self.mode_vocab, self.mode_vocab))

    def sample(self, n: int, length: int, seed: int | np.random.Generator) -> np.ndarray:
        """``n`` sequences of ``length`` tokens (int64 ``[n, length]``), deterministic in ``seed``."""
        if length < 2:
            raise ValueError(f"length must be at least 2, got {length}")
        rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
        s, table = self.mode_vocab, self.rule_table()
        x = np.zeros((n, length), dtype=np.int64)
        mode = rng.integers(0, self.modes, n)
        x[:, 0] = mode * s + rng.integers(0, s, n)
        x[:, 1] = mode * s + rng.integers(0, s, n)
        for t in range(2, length):
            if self.modes > 1:
                switch = rng.random(n) < self.switch_p
                mode = np.where(switch, (mode + rng.integers(1, self.modes, n)) % self.modes, mode)
            rule = table[mode, x[:, t - 2] % s, x[:, t - 1] % s]
            uniform = rng.integers(0, s, n)
            x[:, t] = mode * s + np.where(rng.random(n) < self.rule_p, rule, uniform)
        return x

    def entropy_floor_nats(self) -> float:
        """Exact per-token entropy rate for positions t ≥ 2 (nats): the best achievable cross-entropy."""
        s, p = self.mode_vocab, self.rule_p
        a, b = p + (1 - p) / s, (1 - p) / s
        h = -a * math.log(a) - (s - 1) * b * math.log(b)
        q = self.switch_p
        if q > 0:
            h += -q * math.log(q) - (1 - q) * math.log(1 - q) + q * math.log(self.modes - 1)
        return h

    def uniform_nats(self) -> float:
        return math.log(self.vocab_size)

    def empirical_cross_entropy(self, tokens: np.ndarray) -> float:
        """Cross-entropy (nats/token, positions ≥ 2) of the true generating distribution on ``tokens``:
        converges to ``entropy_floor_nats`` (a check of the formula, used by the tests)."""
        s, table = self.mode_vocab, self.rule_table()
        prev2, prev1, cur = tokens[:, :-2], tokens[:, 1:-1], tokens[:, 2:]
        prev_mode, mode = prev1 // s, cur // s
        stay = prev_mode == mode
        if self.modes > 1:
            p_mode = np.where(stay, 1 - self.switch_p, self.switch_p / (self.modes - 1))
        else:
            p_mode = np.ones_like(cur, dtype=float)
        rule = table[mode, prev2 % s, prev1 % s]
        p_tok = np.where(cur % s == rule, self.rule_p, 0.0) + (1 - self.rule_p) / s
        return float(-np.mean(np.log(p_mode * p_tok)))
