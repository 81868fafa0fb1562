"""Published-layout DFlash drafters: config parsing, the torch-free compatibility check, loading, the drafter KV,
batched drafting, and the tiny generator. Parity with the official implementation: test_dflash_parity.py."""

from __future__ import annotations

import json
import re

import pytest
import torch

from pd_dflash.engine.reference.dflash.config import (
    TINY_DRAFTER,
    build_target_layer_ids,
    check_drafter,
    drafter_problems,
    parse_drafter_config,
    resolve_drafter,
)
from pd_dflash.engine.reference.dflash.load import load_dflash_drafter
from pd_dflash.engine.reference.dflash.model import DraftKV, DraftRows
from pd_dflash.engine.reference.dflash.tiny import (
    published_tensor_shapes,
    tiny_drafter_config,
    tiny_drafter_for,
    write_tiny_drafter,
)
from pd_dflash.errors import InputError
from tests.engine.reference.helpers import tiny_model

TARGET = {"hidden_size": 32, "vocab_size": 64, "num_hidden_layers": 2, "model_type": "qwen3_moe"}


def drafter_dir(tmp_path, name="drafter", seed=0, **overrides):
    return write_tiny_drafter(tmp_path / name, tiny_drafter_config(TARGET, **overrides), seed=seed)


def test_published_config_fields_are_read_like_the_official_package():
    raw = tiny_drafter_config(TARGET, layers=2, block_size=16)
    cfg = parse_drafter_config(raw, "c.json")
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.block_size, cfg.mask_token_id) == (32, 2, 16, 63)
    assert cfg.target_layer_ids == (0, 1) and cfg.num_target_layers == 2
    # top-level values are the fallback of dflash_config's, and the block size defaults to 16
    raw["block_size"] = 4
    del raw["dflash_config"]["block_size"]
    assert parse_drafter_config(raw, "c.json").block_size == 4
    del raw["block_size"]
    assert parse_drafter_config(raw, "c.json").block_size == 16
    # no layer ids: the official default over [1, L − 3]
    del raw["dflash_config"]["target_layer_ids"]
    raw["num_target_layers"] = 48
    assert parse_drafter_config(raw, "c.json").target_layer_ids == tuple(build_target_layer_ids(48, 2))
    assert build_target_layer_ids(48, 5) == [1, 12, 23, 34, 45]
    assert build_target_layer_ids(24, 5) == [1, 6, 11, 16, 21]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c: c.pop("dflash_config"), "no dflash_config"),
        (lambda c: c.update(architectures=["DFlash2DraftModel"]), "DFlash-2 drafters"),
        (lambda c: c.update(architectures=["LlamaForCausalLM"]), "expected"),
        (lambda c: c["dflash_config"].pop("mask_token_id"), "mask_token_id is required"),
        (lambda c: c["dflash_config"].update(target_layer_ids=[]), "non-empty list"),
        (lambda c: c["dflash_config"].update(target_layer_ids=[1, 1]), "repeats a layer"),
        (lambda c: c["dflash_config"].update(block_size=1), "block_size must be an integer ≥ 2"),
        (lambda c: c.update(num_key_value_heads=3), "not a multiple"),
        (lambda c: c.update(hidden_act="gelu"), "hidden_act"),
        (lambda c: c.update(hidden_size="32"), "hidden_size must be an integer"),
    ],
)
def test_malformed_drafter_configs_are_input_errors_naming_the_field(change, message):
    raw = tiny_drafter_config(TARGET)
    change(raw)
    with pytest.raises(InputError, match=message) as err:
        parse_drafter_config(raw, "/d/config.json")
    assert "/d/config.json" in str(err.value)


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ({**TARGET, "hidden_size": 64}, "hidden_size 32 differs from the target's 64"),
        ({**TARGET, "vocab_size": 128}, "vocab_size 64 differs from the target's 128"),
        ({**TARGET, "num_hidden_layers": 1}, r"target_layer_ids \[0, 1\] has \[1\] outside"),
        ({**TARGET, "num_hidden_layers": 3}, "num_target_layers 2 differs from the target's 3"),
    ],
)
def test_a_drafter_that_does_not_fit_its_target_is_named(target, message):
    cfg = parse_drafter_config(tiny_drafter_config(TARGET), "d/config.json")
    problems = drafter_problems(target, cfg, target_where="t/config.json", drafter_where="d/config.json")
    assert any(re.search(message, p) for p in problems), problems
    assert all("d/config.json" in p and "t/config.json" in p for p in problems)


def test_mask_token_outside_the_target_vocabulary_is_refused():
    raw = tiny_drafter_config(TARGET, mask_token_id=64)
    raw.pop("vocab_size")
    cfg = parse_drafter_config(raw, "d")
    assert any(
        "mask_token_id 64 is outside" in p
        for p in drafter_problems(TARGET, cfg, target_where="t", drafter_where="d")
    )
    assert (
        drafter_problems(
            TARGET,
            parse_drafter_config(tiny_drafter_config(TARGET), "d"),
            target_where="t",
            drafter_where="d",
        )
        == []
    )


def test_check_drafter_before_the_sweep(tmp_path):
    good = drafter_dir(tmp_path)
    assert check_drafter(str(good), TARGET, target_where="t") is None
    assert check_drafter(TINY_DRAFTER, TARGET, target_where="t") is None
    assert check_drafter("", TARGET, target_where="t") is None
    with pytest.raises(InputError, match=r"does not fit its target.*hidden_size") as err:
        check_drafter(str(good), {**TARGET, "hidden_size": 48}, target_where="t/config.json")
    assert err.value.where == "models[].draft"
    # not on this machine: a note for plan, an error where it must load
    env = {"HF_HOME": str(tmp_path / "hf")}
    note = check_drafter("z-lab/gpt-oss-20b-DFlash", TARGET, target_where="t", env=env)
    assert "not found here" in note and "models--z-lab--gpt-oss-20b-DFlash" in note
    with pytest.raises(InputError, match="not found here"):
        check_drafter("z-lab/gpt-oss-20b-DFlash", TARGET, target_where="t", env=env, require_present=True)
    (good / "config.json").write_text("{not json")
    with pytest.raises(InputError, match="invalid JSON"):
        check_drafter(str(good), TARGET, target_where="t")


def test_plan_notes_block_sizes_above_the_drafters_trained_one(tmp_path):
    """z-lab/gpt-oss-20b-DFlash is trained at B = 8: a spec with B = 16 is told so at plan (issue 22)."""
    good = drafter_dir(tmp_path, block_size=8)
    assert check_drafter(str(good), TARGET, target_where="t", block_sizes=[4, 8]) is None
    note = check_drafter(str(good), TARGET, target_where="t", block_sizes=[8, 16, 32])
    assert "trained for block size 8" in note and "B = 16, 32" in note and "dflash_config.block_size" in note


def test_a_hub_id_resolves_from_the_hf_cache(tmp_path):
    repo = tmp_path / "hub" / "models--z-lab--tiny-DFlash"
    snap = repo / "snapshots" / "abc123"
    write_tiny_drafter(snap, tiny_drafter_config(TARGET))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123\n")
    found, _ = resolve_drafter("z-lab/tiny-DFlash", {"HF_HUB_CACHE": str(tmp_path / "hub")})
    assert found == snap
    assert (
        check_drafter(
            "z-lab/tiny-DFlash", TARGET, target_where="t", env={"HF_HUB_CACHE": str(tmp_path / "hub")}
        )
        is None
    )


def test_the_generator_writes_the_published_tensor_names(tmp_path):
    from safetensors import safe_open

    d = drafter_dir(tmp_path, layers=2)
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    cfg = parse_drafter_config(json.loads((d / "config.json").read_text()), "c")
    assert names == set(published_tensor_shapes(cfg))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.q_norm.weight"} <= names
    assert "layers.0.mlp.gate_proj.weight" in names and "embed_tokens.weight" not in names
    # seeded: the same seed, the same bytes; another seed, other weights
    same, other = drafter_dir(tmp_path, "b", layers=2), drafter_dir(tmp_path, "c", seed=1, layers=2)
    assert (same / "model.safetensors").read_bytes() == (d / "model.safetensors").read_bytes()
    assert (other / "model.safetensors").read_bytes() != (d / "model.safetensors").read_bytes()


def test_the_tiny_drafter_name_is_generated_once_into_the_cache(tmp_path):
    first = tiny_drafter_for(TARGET, tmp_path)
    assert first.name.startswith(TINY_DRAFTER) and (first / "config.json").is_file()
    assert tiny_drafter_for(TARGET, tmp_path) == first
    assert tiny_drafter_for({**TARGET, "hidden_size": 48}, tmp_path) != first


@pytest.fixture(scope="module")
def target():
    torch.set_num_threads(1)
    return tiny_model("qwen3_moe")


def test_load_refuses_missing_or_misshapen_tensors(tmp_path, target):
    from safetensors.torch import load_file, save_file

    d = drafter_dir(tmp_path)
    tensors = load_file(str(d / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if k != "fc.weight"}, str(d / "model.safetensors"))
    with pytest.raises(InputError, match=r"'fc\.weight' is missing"):
        load_dflash_drafter(d, target)
    save_file(
        {**tensors, "fc.weight": tensors["fc.weight"][:, :32].contiguous()}, str(d / "model.safetensors")
    )
    with pytest.raises(InputError, match=r"'fc.weight' is \[32, 32\], expected \[32, 64\]"):
        load_dflash_drafter(d, target)
    (d / "model.safetensors").unlink()
    with pytest.raises(InputError, match="no safetensors weights"):
        load_dflash_drafter(d, target)
    wrong = write_tiny_drafter(tmp_path / "wrong", tiny_drafter_config({**TARGET, "hidden_size": 48}))
    with pytest.raises(InputError, match="hidden_size 48 differs"):
        load_dflash_drafter(wrong, target)


def test_extra_tensors_are_ignored_and_listed(tmp_path, target):
    from safetensors.torch import load_file, save_file

    d = drafter_dir(tmp_path)
    tensors = load_file(str(d / "model.safetensors"))
    save_file({**tensors, "embed_tokens.weight": torch.zeros(64, 32)}, str(d / "model.safetensors"))
    _, facts = load_dflash_drafter(d, target)
    assert facts["ignored_tensors"] == ["embed_tokens.weight"]
    assert facts["target_layer_ids"] == [0, 1] and facts["attention"] == ["non-causal"]


def test_the_drafter_kv_keeps_only_committed_context(tmp_path, target):
    drafter, _ = load_dflash_drafter(drafter_dir(tmp_path, layers=2), target)
    gen = torch.Generator().manual_seed(0)
    ctx = [torch.randn(n, 64, generator=gen) for n in (5, 3, 1)]
    kv = DraftKV()
    outs = []
    for step, c in enumerate(ctx):
        outs.append(drafter([DraftRows(kv, c, 7 + step)], 4))
        assert kv.length == sum(x.shape[0] for x in ctx[: step + 1])  # the 4 block rows were cropped
    # the same context delivered at once gives the same KV, hence the same next draft
    kv2 = DraftKV()
    drafter([DraftRows(kv2, torch.cat(ctx[:2]), 8)], 4)
    again = drafter([DraftRows(kv2, ctx[2], 9)], 4)
    assert torch.allclose(again, outs[2], atol=1e-5)
    for layer in range(2):  # context keys depend on their rows and positions only, not on how they arrived
        assert torch.allclose(kv2.keys[layer][:, :9], kv.keys[layer][:, :9], atol=1e-5)


def test_requests_drafted_together_draft_what_each_drafts_alone(tmp_path, target):
    drafter, _ = load_dflash_drafter(drafter_dir(tmp_path, layers=2), target)
    gen = torch.Generator().manual_seed(1)
    contexts = [torch.randn(n, 64, generator=gen) for n in (6, 2, 9)]
    alone = [drafter([DraftRows(DraftKV(), c, 3 + i)], 8) for i, c in enumerate(contexts)]
    together = drafter([DraftRows(DraftKV(), c, 3 + i) for i, c in enumerate(contexts)], 8)
    for i, h in enumerate(alone):
        assert torch.allclose(together[i], h[0], atol=1e-5)
        assert torch.equal(drafter.logits(together[i, 1:]).argmax(-1), drafter.logits(h[0, 1:]).argmax(-1))


def test_blocks_larger_than_the_trained_block_run(tmp_path, target):
    drafter, facts = load_dflash_drafter(drafter_dir(tmp_path, block_size=4), target)
    assert facts["trained_block_size"] == 4
    hidden = drafter([DraftRows(DraftKV(), torch.randn(3, 64), 5)], 16)
    assert hidden.shape == (1, 16, 32) and torch.isfinite(hidden).all()


def test_a_non_numeric_scale_is_named():
    raw = tiny_drafter_config(TARGET)
    raw["dflash_config"]["output_multiplier"] = "2"
    with pytest.raises(InputError, match=r"dflash_config\.output_multiplier must be a number"):
        parse_drafter_config(raw, "c.json")


SLIDING = {
    "layer_types": ["sliding_attention", "full_attention"],
    "use_sliding_window": True,
    "sliding_window": 5,
}


@pytest.mark.parametrize(
    ("rule", "attention"),
    [
        ({}, ["non-causal", "non-causal"]),  # the published drafters' rule
        ({"is_causal": True}, ["causal", "causal"]),
        (SLIDING, ["sliding", "non-causal"]),
    ],
    ids=["non-causal", "causal", "sliding"],
)
def test_the_training_forward_computes_what_serving_drafts(tmp_path, target, rule, attention):
    """Training's teacher-forced blocks (context: every position before the anchor) equal the serving path's,
    where the same context reaches the drafter KV in pieces over several drafts; the layer rule holds in both."""
    drafter, facts = load_dflash_drafter(
        drafter_dir(tmp_path, layers=2, num_key_value_heads=1, **rule), target
    )
    assert facts["attention"] == attention
    gen = torch.Generator().manual_seed(4)
    features = torch.randn(2, 20, 64, generator=gen)  # two sequences, the target's features at every position
    anchor_ids = torch.randint(0, 64, (2, 3), generator=gen)
    anchors = torch.tensor([[4, 9, 15], [1, 6, 14]])
    trained = drafter.teacher_forced(features, anchor_ids, anchors, 6)
    assert trained.requires_grad and trained.shape == (2, 3, 6, 32)
    for seq in range(2):
        kv, served = DraftKV(), []
        for a in range(3):
            context = features[seq, kv.length : int(anchors[seq, a])]
            served.append(drafter([DraftRows(kv, context, int(anchor_ids[seq, a]))], 6)[0])
        torch.testing.assert_close(trained[seq].detach(), torch.stack(served), atol=1e-5, rtol=1e-4)
        logits = drafter.logits(trained[seq, :, 1:]).detach()
        torch.testing.assert_close(logits, drafter.logits(torch.stack(served)[:, 1:]), atol=1e-5, rtol=1e-4)
