"""The model families: one module each behind ``MoEFamily``, found through one registry, torch-free at import."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from pd_dflash.engine.reference import families
from pd_dflash.engine.reference.checkpoints.resolve import TINY_REAL
from pd_dflash.engine.reference.checkpoints.tiny import TINY, TINY_CODE_FILES
from pd_dflash.engine.reference.families import (
    FAMILIES,
    FAMILY_FILES,
    checkpoint_family,
    expert_layout,
    family_named,
)
from pd_dflash.engine.reference.families.layouts import Source
from pd_dflash.engine.reference.presets.catalog import PRESETS, Preset, build_config
from pd_dflash.engine.reference.prompts import needs_chat_template
from pd_dflash.errors import InputError

REFERENCE = Path(families.__file__).parents[1]
QWEN = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 8,
    "moe_intermediate_size": 4,
    "num_hidden_layers": 3,
    "num_experts": 2,
    "mlp_only_layers": [1],
}


def test_every_family_is_registered_under_its_name_and_keys_the_caches():
    assert list(FAMILIES) == ["qwen3_moe", "mixtral", "gpt_oss"]
    for name, family in FAMILIES.items():
        assert family.name == name and family_named(name) is family
        module = f"families/{type(family).__module__.rsplit('.', 1)[1]}.py"
        assert module in FAMILY_FILES and module in TINY_CODE_FILES
    assert all((REFERENCE / f).is_file() for f in (*FAMILY_FILES, *TINY_CODE_FILES))
    # The tiny checkpoints the resolver knows are the ones the families write.
    assert tuple(TINY) == TINY_REAL == ("tiny-real-qwen3-moe", "tiny-real-gpt-oss")
    with pytest.raises(
        ValueError, match=r"unknown model family 'llama' \(known: qwen3_moe, mixtral, gpt_oss\)"
    ):
        family_named("llama")


def test_a_preset_names_a_registered_family_and_gets_its_config():
    with pytest.raises(ValidationError, match="unknown model family 'llama'"):
        Preset.model_validate({**PRESETS["micro"].model_dump(), "family": "llama"})
    for preset in PRESETS.values():
        config = build_config(preset)
        assert config.model_type == preset.family
        assert families.family_of(config) is family_named(preset.family)


def test_a_checkpoint_config_finds_its_family_or_is_refused_naming_the_field():
    assert checkpoint_family(QWEN, "c.json") is FAMILIES["qwen3_moe"]
    with pytest.raises(
        InputError, match=r"architectures: 'MixtralForCausalLM' is not supported .* GptOssForCausalLM"
    ):
        checkpoint_family({"architectures": ["MixtralForCausalLM"]}, "c.json")
    with pytest.raises(
        InputError, match="model_type: 'gpt_oss' does not match architecture Qwen3MoeForCausalLM"
    ):
        checkpoint_family({**QWEN, "model_type": "gpt_oss"}, "c.json")
    with pytest.raises(
        InputError,
        match=r"quant_method: 'mxfp4' is not supported for Qwen3MoeForCausalLM \(supported: "
        r"unquantized, or mxfp4 for GptOssForCausalLM\)",
    ):
        expert_layout({**QWEN, "quantization_config": {"quant_method": "mxfp4"}})
    with pytest.raises(InputError, match="missing or invalid field 'moe_intermediate_size'"):
        expert_layout({k: v for k, v in QWEN.items() if k != "moe_intermediate_size"})


def test_the_hub_layout_stacks_gate_then_up_rows_per_expert():
    layout = expert_layout(QWEN)
    assert layout.moe_layers == (0, 2) and layout.storage == "bf16"
    p = "model.layers.2.mlp.experts"
    assert layout.sources(2)[:3] == [
        Source(0, f"{p}.0.gate_proj.weight", (4, 8), 0, 0),
        Source(0, f"{p}.0.up_proj.weight", (4, 8), 0, 4),
        Source(1, f"{p}.0.down_proj.weight", (8, 4), 0, 0),
    ]
    assert len(layout.sources(2)) == 6
    names = FAMILIES["qwen3_moe"].non_expert_tensors(QWEN, layout)
    assert "model.layers.0.mlp.gate.weight" in names and "model.layers.1.mlp.gate.weight" not in names
    assert "model.layers.1.self_attn.q_norm.weight" in names


def test_chat_only_families_need_their_template_whatever_the_id():
    assert needs_chat_template("openai/gpt-oss-20b", FAMILIES["gpt_oss"])
    assert not needs_chat_template("Qwen/Qwen3-30B-A3B", FAMILIES["qwen3_moe"])
    assert needs_chat_template("Qwen/Qwen3-Coder-30B-A3B-Instruct", FAMILIES["qwen3_moe"])


def test_attention_windows_follow_each_familys_rule():
    gpt = build_config(PRESETS["mini-gpt-oss"])
    assert FAMILIES["gpt_oss"].attention_windows(gpt) == [128, None, 128, None]
    qwen = build_config(PRESETS["micro"])
    assert FAMILIES["qwen3_moe"].attention_windows(qwen) == [qwen.sliding_window] * qwen.num_hidden_layers


def test_the_registry_and_the_plan_time_checks_import_no_torch():
    code = (
        "import sys\n"
        "from pd_dflash.engine.reference import families, spec_check\n"
        "from pd_dflash.engine.reference.checkpoints import check, tiny\n"
        "families.expert_layout({'architectures': ['GptOssForCausalLM'], 'hidden_size': 64, "
        "'intermediate_size': 64, 'num_hidden_layers': 2, 'num_local_experts': 4, "
        "'quantization_config': {'quant_method': 'mxfp4'}})\n"
        "bad = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
