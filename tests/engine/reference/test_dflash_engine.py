"""Real-layout targets with published-layout DFlash drafters through the engine: every configuration lossless
(equal to greedy AR, which equals HF ``generate``), route-ahead's per-layer recall, prompts and their token
counts in the row, and the refusals (no drafter, a drafter that does not fit, no chat template)."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from pd_dflash.engine.interface import Refused
from pd_dflash.engine.reference.dflash.config import TINY_DRAFTER
from pd_dflash.engine.reference.dflash.tiny import tiny_drafter_config, write_tiny_drafter
from pd_dflash.engine.reference.models import make_prompts
from pd_dflash.schema import EngineResult, Row, Status
from pd_dflash.spec import expand
from pd_dflash.spec_inputs import DEFAULT_CHAT_DATE
from tests.engine.reference.helpers import CHAT_TEMPLATE, make_engine, make_spec, make_tokenizer, tiny_model

LINK = {"emulated_h2d_gbps": 4.0}
PROMPTS = ["w1 w2 w3 w4 w5", "w9 w8 w7", "w3 w3 w4 w10 w11 w12 w13", "w20 w21"]
WORKLOAD = {"requests": 3, "warmup_rounds": 1, "max_new_tokens": 14, "seed": 5}


def checkpoint(root, family, *, chat_template=CHAT_TEMPLATE):
    """A tiny fp32 checkpoint in transformers' own layout, named like an instruct model, with a tokenizer."""
    path = root / f"tiny-{family}-Instruct"
    tiny_model(family, seed=3).save_pretrained(str(path))
    make_tokenizer(path, chat_template=chat_template)
    return path


def prompt_file(root):
    path = root / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return f"file:{path}"


def spec_for(
    ckpt, draft, prompts, *, baselines=("B0", "B1", "B2", "B3", "OURS"), block_sizes=(4,), conc=(1, 3)
):
    spec = make_spec(
        baselines=baselines,
        concurrency=list(conc),
        model={"id": str(ckpt), "draft": str(draft), "engine_options": LINK},
        workload={**WORKLOAD, "prompts": prompts},
        memory={"expert_cache_fraction": 0.5},
    )
    return spec.model_copy(update={"block_sizes": list(block_sizes)})


def run(spec):
    """(the engine's loaded model, rows by (baseline, B, c)); a refusal becomes its row, as the runner does."""
    engine = make_engine(spec)
    rows = {}
    try:
        for c in expand(spec):
            try:
                result = engine.run_cell(c)
            except Refused as refusal:
                result = EngineResult(status=refusal.status, reason=refusal.reason)
            rows[(c.baseline, c.block_size, c.concurrency)] = Row.from_result(c, result)
        return engine.loaded, rows
    finally:
        engine.close()


def hf_generate_digest(ckpt, prompts, max_new, eos):
    """The output digest HF ``generate`` gives on the same prompts (the rows' ``output_digest`` formula)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(ckpt), local_files_only=True).eval()
    outputs = []
    for p in prompts:
        ids = torch.tensor([p])
        out = model.generate(ids, max_new_tokens=max_new, do_sample=False, eos_token_id=eos, pad_token_id=0)
        new = out[0, len(p) :].tolist()
        stop = next((i for i, t in enumerate(new) if t in (eos or ())), None)  # any of the eos ids
        outputs.append(new if stop is None else new[: stop + 1])
    return hashlib.sha256(json.dumps(outputs).encode()).hexdigest()[:16]


def accepting_drafter(ckpt, out, prompts):
    """A published-layout drafter whose drafts get accepted now and then: its layers' output projections are
    zero and its final norm is set so that the mask token reads as the target's most frequent greedy token
    (a random drafter is accepted ≈ never, which would leave partial acceptance and rollback untested)."""
    from collections import Counter

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(str(ckpt), local_files_only=True).eval()
    counts = Counter()
    for p in prompts:
        ids = target.generate(
            torch.tensor([p]), max_new_tokens=WORKLOAD["max_new_tokens"], do_sample=False, pad_token_id=0
        )
        counts.update(ids[0, len(p) :].tolist())
    top = counts.most_common(1)[0][0]
    out = write_tiny_drafter(
        out, tiny_drafter_config(target.config.to_dict(), layers=2, block_size=4, mask_token_id=0)
    )
    tensors = load_file(str(out / "model.safetensors"))
    x = target.get_input_embeddings().weight[0].detach()
    tensors["norm.weight"] = (
        target.lm_head.weight[top].detach() * x.pow(2).mean().add(1e-6).sqrt() / x
    ).contiguous()
    for name in tensors:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensors[name] = torch.zeros_like(tensors[name])
    save_file(tensors, str(out / "model.safetensors"))
    return out


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_every_configuration_is_lossless_with_a_published_layout_drafter(tmp_path, family):
    torch.set_num_threads(1)
    ckpt = checkpoint(tmp_path, family)
    spec = spec_for(ckpt, tmp_path / "drafter", prompt_file(tmp_path))
    loaded, _ = run(spec.model_copy(update={"baselines": ["B3"], "concurrency": [1]}))
    prompts = make_prompts(loaded, spec.workload.prompts, WORKLOAD["requests"], 32, seed=WORKLOAD["seed"])
    drafter = accepting_drafter(ckpt, tmp_path / "drafter", prompts)
    loaded, rows = run(spec)
    reference = rows[("B0", 4, 1)].engine["output_digest"]
    for key, row in rows.items():
        assert row.status == Status.OK, (key, row.reason, row.warnings)
        assert row.engine["output_digest"] == reference, key
        facts = row.engine["prompts"]
        assert facts["chat_template"] is True and facts["requests"] == WORKLOAD["requests"]
        assert facts["output_tokens"]["total"] == row.generated_tokens
        assert facts["prompt_tokens"]["min"] > len(PROMPTS[-1].split())  # the chat template's tokens too
    assert (
        hf_generate_digest(ckpt, prompts, WORKLOAD["max_new_tokens"], sorted(loaded.eos_token_ids) or None)
        == reference
    )
    for baseline in ("B1", "B2", "OURS"):
        row = rows[(baseline, 4, 3)]
        drafter_facts = row.engine["drafter"]
        assert drafter_facts["kind"] == "dflash" and drafter_facts["checkpoint"] == str(drafter)
        assert drafter_facts["peak_draft_kv_bytes"] > 0 and not row.warnings
        assert len(row.acceptance_histogram) > 1 and row.acceptance_length_a > 1.0  # partial acceptance
        assert row.engine["batch"]["requests_per_forward_max"] == 3  # drafted and verified together
    ours = rows[("OURS", 4, 3)].engine["prediction"]["per_layer"]
    assert sorted(ours) == ["0", "1"]  # every MoE layer of the target
    assert ours["0"]["recall"] == 1.0  # the first MoE layer's gate input is exact
    assert 0.0 < ours["1"]["recall"] <= 1.0  # deeper: from the drafter's hidden states


def test_a_block_above_the_trained_block_size_runs_with_a_warning(tmp_path):
    torch.set_num_threads(1)
    ckpt = checkpoint(tmp_path, "qwen3_moe")
    drafter = write_tiny_drafter(
        tmp_path / "d", tiny_drafter_config(json.loads((ckpt / "config.json").read_text()), block_size=4)
    )
    _, rows = run(
        spec_for(ckpt, drafter, prompt_file(tmp_path), baselines=("B0", "B1"), block_sizes=(4, 8), conc=(2,))
    )
    assert rows[("B1", 8, 2)].status == Status.OK
    (b0,) = [row for (baseline, _, _), row in rows.items() if baseline == "B0"]  # measured once for every B
    assert rows[("B1", 8, 2)].engine["output_digest"] == b0.engine["output_digest"]
    (warning,) = rows[("B1", 8, 2)].warnings
    assert "block size 8 is above the DFlash drafter's trained block size 4" in warning
    assert "dflash_config.block_size" in warning and not rows[("B1", 4, 2)].warnings
    assert rows[("B1", 8, 2)].engine["drafter"]["trained_block_size"] == 4  # read from its config


def test_the_tiny_drafter_name_runs_on_any_checkpoint(tmp_path):
    torch.set_num_threads(1)
    ckpt = checkpoint(tmp_path, "gpt_oss")
    _, rows = run(spec_for(ckpt, TINY_DRAFTER, prompt_file(tmp_path), baselines=("B0", "OURS"), conc=(2,)))
    assert rows[("OURS", 4, 2)].status == Status.OK
    assert rows[("OURS", 4, 2)].engine["drafter"]["draft"] == TINY_DRAFTER
    assert rows[("OURS", 4, 2)].engine["output_digest"] == rows[("B0", 4, 2)].engine["output_digest"]


def test_a_drafter_that_does_not_fit_refuses_the_speculative_cells(tmp_path):
    ckpt = checkpoint(tmp_path, "qwen3_moe")
    wrong = write_tiny_drafter(
        tmp_path / "wrong", tiny_drafter_config({"hidden_size": 48, "vocab_size": 64, "num_hidden_layers": 2})
    )
    _, rows = run(spec_for(ckpt, wrong, prompt_file(tmp_path), baselines=("B0", "B1"), conc=(1,)))
    assert rows[("B0", 4, 1)].status == Status.OK
    refused = rows[("B1", 4, 1)]
    assert refused.status == Status.REFUSED
    assert "hidden_size 48 differs from the target's 32" in refused.reason and "config.json" in refused.reason


def test_a_checkpoint_without_a_drafter_is_refused_with_the_fix(tmp_path):
    ckpt = checkpoint(tmp_path, "qwen3_moe")
    _, rows = run(spec_for(ckpt, "", prompt_file(tmp_path), baselines=("B1",), conc=(1,)))
    assert rows[("B1", 4, 1)].status == Status.REFUSED
    assert (
        "models[].draft is empty" in rows[("B1", 4, 1)].reason and "early_exit" in rows[("B1", 4, 1)].reason
    )
    _, rows = run(spec_for(ckpt, tmp_path / "absent", prompt_file(tmp_path), baselines=("B1",), conc=(1,)))
    assert "not found on this box" in rows[("B1", 4, 1)].reason


def test_an_instruct_target_without_chat_template_is_refused_naming_the_file(tmp_path):
    ckpt = checkpoint(tmp_path, "qwen3_moe", chat_template=None)
    _, rows = run(spec_for(ckpt, TINY_DRAFTER, prompt_file(tmp_path), baselines=("B0",), conc=(1,)))
    row = rows[("B0", 4, 1)]
    assert row.status == Status.REFUSED and "no chat_template" in row.reason
    assert str(ckpt / "tokenizer_config.json") in row.reason


def test_humaneval_prompts_on_a_checkpoint(tmp_path):
    torch.set_num_threads(1)
    ckpt = checkpoint(tmp_path, "qwen3_moe")
    spec = spec_for(ckpt, TINY_DRAFTER, "humaneval", baselines=("B0",), conc=(2,))
    spec = spec.model_copy(update={"workload": spec.workload.model_copy(update={"max_new_tokens": 2})})
    _, rows = run(spec)
    facts = rows[("B0", 4, 2)].engine["prompts"]
    assert rows[("B0", 4, 2)].status == Status.OK and facts["source"] == "humaneval"
    assert facts["chat_date"] == DEFAULT_CHAT_DATE  # the fixed date the chat template rendered (issue 22)
    assert facts["prompt_tokens"]["min"] > 20 and facts["output_tokens"]["total"] == 2 * WORKLOAD["requests"]
