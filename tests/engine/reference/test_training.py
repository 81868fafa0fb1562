"""Deterministic preset training, the on-disk cache and its lock, and the model card."""

from __future__ import annotations

import threading

import torch

from pd_dflash.engine.reference.presets.catalog import get_preset
from pd_dflash.engine.reference.presets.training import load_preset, preset_dir, train

TINY = get_preset("micro").model_copy(
    update={"name": "micro-tiny-test", "train_steps": 6, "batch": 4, "seq_len": 16}
)


def test_training_is_deterministic():
    a, card_a = train(TINY, seed=3)
    b, _ = train(TINY, seed=3)
    c, _ = train(TINY, seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)
    assert card_a["train"]["steps"] == 6 and card_a["train"]["threads"] == 1


def test_cache_is_reused_and_concurrent_loaders_train_once(tmp_path):
    results = []

    def load():
        results.append(load_preset(TINY, seed=0, cache_dir=str(tmp_path)))

    threads = [threading.Thread(target=load) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(card["cache_hit"] for _, card in results) == [False, True]  # one trained, one waited
    again, card = load_preset(TINY, seed=0, cache_dir=str(tmp_path))
    assert card["cache_hit"] is True
    first = results[0][0].state_dict()
    assert all(torch.equal(first[k], v) for k, v in again.state_dict().items())
    assert preset_dir(TINY, 0, str(tmp_path)).name.startswith("micro-tiny-test-s0-")
    assert not list(tmp_path.glob("presets/.micro-tiny-test*"))  # no temporary directory left behind


def test_micro_card_reports_loss_sizes_and_routing(micro):
    _, card = micro
    loss = card["loss"]
    assert loss["entropy_floor_nats"] < loss["eval_nats"] < loss["uniform_nats"]
    assert 0 < loss["fraction_of_gap_closed"] < 1
    assert card["sizes"]["experts_per_layer"] == 8 and card["sizes"]["top_k"] == 2
    routing = card["routing"]
    assert routing["reuse_next_token"] > routing["reuse_next_token_if_independent"]  # correlated routing
    assert 0 < routing["usage_entropy_fraction"] <= 1
