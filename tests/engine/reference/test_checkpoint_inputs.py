"""Bad checkpoints are clear InputErrors naming the file and the field or tensor, found before anything loads
(the torch-free check ``pd-dflash plan`` and the engine both run) — never a traceback from deep inside a load."""

from __future__ import annotations

import json
import shutil

import pytest

from pd_dflash.engine.reference.checkpoints.check import check_checkpoint, check_model
from pd_dflash.engine.reference.checkpoints.resolve import resolve
from pd_dflash.engine.reference.checkpoints.tiny import materialise
from pd_dflash.errors import InputError


@pytest.fixture
def copy_of(tmp_path):
    def make(name: str):
        target = tmp_path / name
        shutil.copytree(materialise(name), target)
        return target

    return make


def drop_tensor(directory, name):
    """Remove one tensor from its shard and from the index (a checkpoint that is consistent but incomplete)."""
    from safetensors.torch import load_file, save_file

    index_path = directory / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = directory / index["weight_map"].pop(name)
    tensors = load_file(str(shard))
    del tensors[name]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index_path.write_text(json.dumps(index))


def test_missing_checkpoint_is_a_note_on_a_head_box_and_an_error_where_it_loads(tmp_path):
    nowhere = str(tmp_path / "nowhere")
    note = check_model("org/model", nowhere)
    assert note and "not found here" in note
    with pytest.raises(InputError, match=r"models\[\]\.path: checkpoint not found here"):
        check_model("org/model", nowhere, require_present=True)
    with pytest.raises(InputError, match=r"models\[\]\.id: .*not found"):
        check_model("org/absent-model", env={"HF_HOME": str(tmp_path)}, require_present=True)


def test_hub_id_resolves_from_the_cache_under_hf_home(tmp_path, copy_of):
    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot = repo / "snapshots" / "abc123"
    snapshot.parent.mkdir(parents=True)
    shutil.copytree(copy_of("tiny-real-qwen3-moe"), snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    found = resolve("org/tiny", env={"HF_HOME": str(tmp_path)})
    assert found.source == "hub-cache" and found.directory == snapshot
    assert check_model("org/tiny", env={"HF_HOME": str(tmp_path)}, require_present=True) is None


def test_partial_download_names_the_missing_shard(copy_of):
    ckpt = copy_of("tiny-real-qwen3-moe")
    (ckpt / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(InputError, match=r"shards .* missing: model-00002-of-00002.safetensors") as err:
        check_checkpoint(ckpt)
    assert str(ckpt) in str(err.value)


def test_truncated_shard_is_named(copy_of):
    ckpt = copy_of("tiny-real-qwen3-moe")
    shard = ckpt / "model-00001-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1000])
    with pytest.raises(InputError, match="truncated") as err:
        check_checkpoint(ckpt)
    assert str(shard) in str(err.value)


def test_missing_expert_tensor_is_named(copy_of):
    ckpt = copy_of("tiny-real-qwen3-moe")
    drop_tensor(ckpt, "model.layers.1.mlp.experts.5.up_proj.weight")
    with pytest.raises(InputError, match=r"'model.layers.1.mlp.experts.5.up_proj.weight' .* missing"):
        check_checkpoint(ckpt)


def test_unsupported_architecture_names_config_and_field(copy_of):
    ckpt = copy_of("tiny-real-qwen3-moe")
    config = json.loads((ckpt / "config.json").read_text())
    config.update(architectures=["LlamaForCausalLM"], model_type="llama")
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(InputError, match=r"config.json: architectures: 'LlamaForCausalLM' is not supported"):
        check_checkpoint(ckpt)


def test_mxfp4_checkpoint_without_a_scale_tensor_is_named(copy_of):
    ckpt = copy_of("tiny-real-gpt-oss")
    drop_tensor(ckpt, "model.layers.1.mlp.experts.down_proj_scales")
    with pytest.raises(
        InputError,
        match=r"'model.layers.1.mlp.experts.down_proj_scales' \(MXFP4 scales of layer 1's experts\)",
    ):
        check_checkpoint(ckpt)


def test_instruct_target_needs_a_chat_template(copy_of):
    ckpt = copy_of("tiny-real-gpt-oss")
    check_checkpoint(ckpt, chat_template_for="tiny-real-gpt-oss")
    (ckpt / "chat_template.jinja").unlink()
    check_checkpoint(ckpt)  # token-id prompts need no template
    with pytest.raises(InputError, match=r"tokenizer_config\.json: no chat_template"):
        check_checkpoint(ckpt, chat_template_for="tiny-real-gpt-oss")


def test_engine_load_names_the_bad_file_and_tensor(copy_of):
    """What a runner reports (its load failure becomes ERROR rows with this reason) for a checkpoint that only
    the box has, so plan could not check it."""
    from tests.engine.reference.helpers import make_engine, make_spec

    ckpt = copy_of("tiny-real-gpt-oss")
    drop_tensor(ckpt, "model.layers.0.mlp.experts.gate_up_proj_scales")
    with pytest.raises(InputError) as err:
        make_engine(make_spec(model={"id": "openai/gpt-oss-20b", "path": str(ckpt)}))
    message = str(err.value)
    assert str(ckpt) in message and "'model.layers.0.mlp.experts.gate_up_proj_scales'" in message
    assert "Traceback" not in message and len(message) < 400


def _plan(tmp_path, model, prompts="synthetic"):
    import yaml

    from tests.sweep.helpers import run_cli

    spec = {
        "name": "bad-checkpoint",
        "engine": "reference",
        "models": [model],
        "baselines": ["B0"],
        "block_sizes": [8],
        "concurrency": [1],
        "repeats": 1,
        "workload": {"prompts": prompts},
        "memory": {"expert_cache_fraction": 0.25},
    }
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return run_cli("plan", str(path), env={"HF_HOME": str(tmp_path / "hf")}, timeout=120)


@pytest.mark.parametrize(
    ("breakage", "expected"),
    [
        ("scale", r"'model.layers.1.mlp.experts.down_proj_scales' \(MXFP4 scales of layer 1's experts\)"),
        ("shard", r"shards named by model.safetensors.index.json are missing"),
        ("architecture", r"architectures: 'LlamaForCausalLM' is not supported"),
        ("chat_template", r"tokenizer_config.json: no chat_template"),
    ],
)
def test_plan_exits_2_naming_the_file_of_a_bad_checkpoint(tmp_path, copy_of, breakage, expected):
    import re

    ckpt = copy_of("tiny-real-gpt-oss")
    if breakage == "scale":
        drop_tensor(ckpt, "model.layers.1.mlp.experts.down_proj_scales")
    elif breakage == "shard":
        (ckpt / "model-00002-of-00002.safetensors").unlink()
    elif breakage == "architecture":
        config = json.loads((ckpt / "config.json").read_text())
        config.update(architectures=["LlamaForCausalLM"], model_type="llama")
        (ckpt / "config.json").write_text(json.dumps(config))
    else:
        (ckpt / "chat_template.jinja").unlink()
    prompts = "humaneval" if breakage == "chat_template" else "synthetic"
    proc = _plan(tmp_path, {"id": "openai/gpt-oss-20b", "path": str(ckpt)}, prompts)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert re.search(expected, proc.stderr) and str(ckpt) in proc.stderr and "models.0" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_plan_checks_the_drafter_against_a_visible_checkpoint(tmp_path, copy_of):
    """A drafter whose hidden size differs from the target's: exit 2 naming both files (dflash.config)."""
    ckpt = copy_of("tiny-real-qwen3-moe")
    drafter = tmp_path / "drafter"
    shutil.copytree(copy_of("tiny-real-gpt-oss"), drafter)  # not a DFlash drafter at all
    proc = _plan(tmp_path, {"id": "org/tiny-qwen", "path": str(ckpt), "draft": str(drafter)})
    assert proc.returncode == 2 and "models.0" in proc.stderr and "Traceback" not in proc.stderr
