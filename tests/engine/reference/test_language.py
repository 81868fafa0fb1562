import numpy as np
import pytest

from pd_dflash.engine.reference.presets.language import SyntheticLanguage


def test_entropy_floor_matches_the_generating_distribution():
    lang = SyntheticLanguage(modes=4, mode_vocab=16, rule_p=0.85, switch_p=0.05, seed=3)
    tokens = lang.sample(3000, 200, seed=1)
    assert lang.empirical_cross_entropy(tokens) == pytest.approx(lang.entropy_floor_nats(), rel=0.01)
    assert lang.entropy_floor_nats() < lang.uniform_nats()


def test_single_mode_floor_is_the_emission_entropy():
    lang = SyntheticLanguage(modes=1, mode_vocab=8, rule_p=0.5, switch_p=0.0)
    a, b = 0.5 + 0.5 / 8, 0.5 / 8
    assert lang.entropy_floor_nats() == pytest.approx(-a * np.log(a) - 7 * b * np.log(b))
    with pytest.raises(ValueError, match="single mode"):
        SyntheticLanguage(modes=1, switch_p=0.1)


def test_sampling_is_seeded_and_modes_persist():
    lang = SyntheticLanguage(modes=8, mode_vocab=16, switch_p=0.02)
    a, b = lang.sample(16, 64, seed=5), lang.sample(16, 64, seed=5)
    assert (a == b).all() and not (a == lang.sample(16, 64, seed=6)).all()
    assert a.min() >= 0 and a.max() < lang.vocab_size
    modes = a // lang.mode_vocab
    assert (modes[:, 1:] == modes[:, :-1]).mean() > 0.9  # topics persist: routing is correlated in time
