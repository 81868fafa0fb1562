"""Every id of ``generation_config.eos_token_id`` stops a request (issue 22, item 4): Qwen3 lists 151645 and
151643, and before, only the first one stopped it. AR and speculative commits both stop at the first token that
is any of them."""

from __future__ import annotations

from types import SimpleNamespace

from pd_dflash.engine.reference.decoding.loop import run_requests
from pd_dflash.engine.reference.decoding.speculative import EarlyExitDrafter, SpeculativeDecoding
from pd_dflash.engine.reference.decoding.target import AutoregressiveDecoding, Request
from pd_dflash.engine.reference.models import LoadedModel
from tests.engine.reference.helpers import offloaded_runtime


def loaded_with(eos, source="checkpoint") -> LoadedModel:
    model = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=eos))
    return LoadedModel(model=model, family=None, source=source, name="t")


def test_every_listed_eos_id_is_kept():
    assert loaded_with([151645, 151643]).eos_token_ids == {151645, 151643}
    assert loaded_with(151645).eos_token_ids == {151645}
    assert loaded_with(None).eos_token_ids == frozenset()
    assert loaded_with([151645], source="preset").eos_token_ids == frozenset()  # a preset has no eos


def test_a_request_is_done_at_any_of_its_eos_ids():
    r = Request("r", [1, 2], 10, frozenset({7, 9}))
    r.output = [3, 9]
    assert r.done
    r.output = [9, 3]
    assert not r.done


def run(target, rt, prompt, max_new, eos, decoding):
    r = Request("r", prompt, max_new, eos, cache=target.new_cache())
    run_requests(target, [r], concurrency=1, decoding=decoding, hooks=rt)
    return r.output


def test_ar_and_speculative_stop_at_the_second_listed_eos_id(micro):
    model, _ = micro
    target, rt = offloaded_runtime(model)
    prompt = [3, 17, 5, 9, 33, 12, 7, 40]
    greedy = run(target, rt, prompt, 12, frozenset(), AutoregressiveDecoding())
    assert len(greedy) == 12
    stop = 5
    first = next(i for i, t in enumerate(greedy) if t == greedy[stop])  # the id may occur earlier too
    unused = next(t for t in range(model.config.vocab_size) if t not in greedy)
    eos = frozenset({unused, greedy[stop]})  # the id that stops is not the "first" one of the list
    want = greedy[: first + 1]
    assert run(target, rt, prompt, 12, eos, AutoregressiveDecoding()) == want
    speculative = SpeculativeDecoding(EarlyExitDrafter(target, 1), block_size=8)
    assert run(target, rt, prompt, 12, eos, speculative) == want
    rt.close()
