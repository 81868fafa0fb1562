"""Plan refuses what an engine cannot honour (issue 29, item 2), naming the field and the bound, exit 2: a prompt
beyond the model's positions, concurrency above the requests, an axis the engine does not read, token counts
beyond what the memory pre-check can hold. No torch, no Ray: these are ``pd-dflash plan``'s own checks."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pd_dflash.cli import main
from pd_dflash.engine.reference.presets.catalog import PRESETS
from pd_dflash.spec import parse_spec
from pd_dflash.spec_inputs import generation_tokens, positions_problem
from tests.core.helpers import spec_data

GPT_OSS = {"id": "mini-gpt-oss", "preset": "mini-gpt-oss", "draft": "mini-gpt-oss-dflash"}


def plan(tmp_path: Path, capsys, data: dict) -> tuple[int, str]:
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data))
    capsys.readouterr()
    code = main(["plan", str(path)])
    out = capsys.readouterr()
    return code, out.err + out.out


# -- positions -------------------------------------------------------------------------------------------------


def test_a_5000_token_prompt_on_a_2048_position_preset_is_refused_at_plan(tmp_path, capsys):
    assert PRESETS["mini-gpt-oss"].max_positions == 2048
    data = spec_data(models=[GPT_OSS], block_sizes=[8, 16], workload={"prompt_tokens": 5000})
    code, err = plan(tmp_path, capsys, data)
    assert code == 2, err
    assert "models.0" in err and "5,000 tokens" in err and "2,048" in err and "max_positions" in err
    assert "workload.max_new_tokens (64)" in err and "B = 16" in err and "Traceback" not in err


def test_the_bound_is_prompt_plus_max_new_tokens_plus_the_verify_block(tmp_path, capsys):
    # B = 8, max_new_tokens auto = 32: 2048 - 32 - 8 = 2008 tokens of prompt fit, one more does not.
    fits = spec_data(models=[GPT_OSS], workload={"prompt_tokens": 2008})
    assert plan(tmp_path, capsys, fits)[0] == 0
    code, err = plan(tmp_path, capsys, spec_data(models=[GPT_OSS], workload={"prompt_tokens": 2009}))
    assert code == 2 and "2,049 positions" in err, err
    # Autoregressive only (B0): no verify block.
    b0 = spec_data(models=[GPT_OSS], baselines=["B0"], workload={"prompt_tokens": 2016})
    assert plan(tmp_path, capsys, b0)[0] == 0


def test_max_new_tokens_beyond_the_positions_is_refused_at_plan(tmp_path, capsys):
    code, err = plan(tmp_path, capsys, spec_data(workload={"max_new_tokens": 10**9}))
    assert code == 2, err
    assert "workload.max_new_tokens" in err and "Traceback" not in err


def test_a_preset_prompt_file_of_token_ids_is_counted(tmp_path, capsys):
    prompts = tmp_path / "ids.txt"
    prompts.write_text("1 2 3\n" + " ".join(["5"] * 3000) + "\n")
    code, err = plan(tmp_path, capsys, spec_data(models=[GPT_OSS], workload={"prompts": str(prompts)}))
    assert code == 2 and "3,000 tokens" in err and "models.0" in err, err
    prompts.write_text("1 2 3\n4 5 6 7\n")
    assert plan(tmp_path, capsys, spec_data(models=[GPT_OSS], workload={"prompts": str(prompts)}))[0] == 0


def test_the_longest_cell_decides_the_bound():
    spec = parse_spec(
        spec_data(baselines=["B0", "OURS"], block_sizes=[8, 16], workload={"max_new_tokens": 40})
    )
    assert generation_tokens(spec) == (40, 16)
    auto = parse_spec(spec_data(baselines=["B0", "OURS"], block_sizes=[8, 16]))
    assert generation_tokens(auto) == (64, 16)  # auto: max(4 B, 32) at B = 16
    only_b0 = parse_spec(spec_data(baselines=["B0"], block_sizes=[8, 16]))
    assert generation_tokens(only_b0) == (64, 0)  # B0 stands for the largest block, verifies none
    assert positions_problem(10, 5, 1, 16, model="m", bound="b", lower=False) is None
    text = positions_problem(10, 5, 2, 16, model="m", bound="b", lower=True)
    assert text is not None and "at least 10 tokens" in text and "17 positions" in text and "16" in text


# -- concurrency above the requests ------------------------------------------------------------------------------


@pytest.mark.parametrize("above", [16, 100000])
def test_concurrency_above_the_requests_is_refused_at_plan(tmp_path, capsys, above):
    data = spec_data(concurrency=[1, 4, above], workload={"requests": 8})
    code, err = plan(tmp_path, capsys, data)
    assert code == 2, err
    assert "concurrency" in err and f"c = {above:,}" in err and "workload.requests = 8" in err
    assert "Traceback" not in err


def test_concurrency_equal_to_the_requests_is_planned(tmp_path, capsys):
    assert plan(tmp_path, capsys, spec_data(concurrency=[1, 8], workload={"requests": 8}))[0] == 0


def test_a_custom_engine_is_held_to_the_same_rule(tmp_path, capsys):
    data = spec_data(
        engine="tests.sweep.engines:FixedDurationEngine", concurrency=[4], workload={"requests": 2}
    )
    data["models"] = [{"id": "m1"}]
    code, err = plan(tmp_path, capsys, data)
    assert code == 2 and "workload.requests = 2" in err, err


# -- axes an engine does not read ----------------------------------------------------------------------------------

MOE_INFINITY = {
    "engine": "moe_infinity",
    "models": [
        {"id": "openai/gpt-oss-20b", "draft": "z-lab/gpt-oss-20b-DFlash", "offload_dir": "/tmp/offload"}
    ],
    "baselines": ["B0", "B1", "OURS"],
}


@pytest.mark.parametrize(
    ("memory", "field"),
    [
        ({"expert_cache_fraction": [0.25, 0.5]}, "memory.expert_cache_fraction"),
        ({"expert_cache_fraction": 0.25}, "memory.expert_cache_fraction"),
    ],
)
def test_moe_infinity_refuses_the_expert_cache_fraction_it_does_not_read(tmp_path, capsys, memory, field):
    code, err = plan(tmp_path, capsys, spec_data(**MOE_INFINITY, memory=memory))
    assert code == 2, err
    assert field in err and "does not read" in err and "memory.device_memory_ratio" in err
    assert ("one measurement under each label" in err) == isinstance(memory["expert_cache_fraction"], list)


def test_moe_infinity_plans_the_fields_it_reads(tmp_path, capsys):
    memory = {"device_memory_ratio": 0.8, "resident_memory_ratio": 0.97}
    code, err = plan(tmp_path, capsys, spec_data(**MOE_INFINITY, memory=memory))
    assert code == 0, err


@pytest.mark.parametrize(
    ("over", "field"),
    [
        ({"memory": {"device_memory_ratio": 0.5}}, "memory.device_memory_ratio"),
        (
            {"memory": {"expert_cache_fraction": 0.25, "resident_memory_ratio": 0.9}},
            "memory.resident_memory_ratio",
        ),
    ],
)
def test_the_reference_engine_refuses_moe_infinitys_memory_ratios(tmp_path, capsys, over, field):
    code, err = plan(tmp_path, capsys, spec_data(**over))
    assert code == 2 and field in err and "engine reference does not read" in err, err


def test_moe_infinity_refuses_prompt_kinds_and_a_chat_date_it_does_not_read(tmp_path, capsys):
    code, err = plan(tmp_path, capsys, spec_data(**MOE_INFINITY, workload={"prompts": "humaneval"}))
    assert code == 2 and "workload.prompts" in err and "humaneval prompts" in err, err
    code, err = plan(tmp_path, capsys, spec_data(**MOE_INFINITY, workload={"chat_date": "2026-01-31"}))
    assert code == 2 and "workload.chat_date" in err, err


def test_an_unread_axis_does_not_double_the_plan_it_is_refused_before(tmp_path, capsys):
    # The ablation list is refused before any cell is expanded: nothing is printed as a plan.
    data = spec_data(**MOE_INFINITY, memory={"expert_cache_fraction": [0.25, 0.5]})
    code, out = plan(tmp_path, capsys, data)
    assert code == 2 and "cells per model" not in out


# -- token counts beyond any memory pre-check ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("workload", "field"),
    [
        ({"max_new_tokens": 10**9}, "workload.max_new_tokens"),
        ({"prompt_tokens": 10**9}, "workload.prompt_tokens"),
    ],
)
def test_token_counts_no_model_holds_are_refused_at_plan_for_every_engine(tmp_path, capsys, workload, field):
    # MoE-Infinity: its checkpoint's positions are not known at plan; the bound holds for every engine.
    code, err = plan(tmp_path, capsys, spec_data(**MOE_INFINITY, workload=workload))
    assert code == 2, err
    assert field in err and "16,777,216" in err and "Traceback" not in err


def test_moe_infinity_checks_a_visible_checkpoints_positions_at_plan(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text('{"max_position_embeddings": 128}')
    model = {**MOE_INFINITY["models"][0], "path": str(ckpt)}
    # The adapter's synthetic prompts are windows of exactly prompt_tokens: 89 + 32 (auto) + 8 > 128.
    data = spec_data(**{**MOE_INFINITY, "models": [model]}, workload={"prompt_tokens": 89})
    code, err = plan(tmp_path, capsys, data)
    assert code == 2, err
    assert "models.0" in err and "89 tokens" in err and "128" in err and str(ckpt / "config.json") in err
    data = spec_data(
        **{**MOE_INFINITY, "models": [model]}, workload={"prompt_tokens": 88}
    )  # 88 + 32 + 8 = 128
    assert plan(tmp_path, capsys, data)[0] == 0


def test_run_refuses_what_plan_refuses_before_ray_starts(tmp_path, capsys):
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec_data(concurrency=[16], workload={"requests": 8})))
    capsys.readouterr()
    assert main(["run", str(path), "--out", str(tmp_path / "out"), "--no-progress"]) == 2
    assert "workload.requests = 8" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_preset_refuses_text_prompts_at_plan_it_has_no_tokenizer(tmp_path, capsys):
    code, err = plan(tmp_path, capsys, spec_data(workload={"prompts": "humaneval"}))
    assert code == 2 and "workload.prompts" in err and "need a tokenizer" in err and "micro" in err, err
    words = tmp_path / "words.txt"
    words.write_text("12 13\nwrite a function that sorts a list\n")
    code, err = plan(tmp_path, capsys, spec_data(workload={"prompts": str(words)}))
    assert code == 2 and "prompt 2" in err and "token ids" in err, err
