"""Every field of a checkpoint's JSON files has its type checked and a wrong one is named by file and key (issue
22, defect 5): a safetensors header that is a list, offsets that are strings, an index whose weight_map is a
list, config.json fields of the wrong type, a drafter config likewise — InputErrors at plan (exit 2), never an
AttributeError/ValueError traceback."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import yaml

from pd_dflash.cli import main
from pd_dflash.engine.reference.checkpoints.check import check_checkpoint
from pd_dflash.engine.reference.checkpoints.fields import generation_eos_ids
from pd_dflash.engine.reference.checkpoints.tiny import materialise
from pd_dflash.engine.reference.dflash.config import parse_drafter_config
from pd_dflash.errors import InputError

INDEX = "model.safetensors.index.json"


@pytest.fixture
def qwen(tmp_path) -> Path:
    target = tmp_path / "ckpt"
    shutil.copytree(materialise("tiny-real-qwen3-moe"), target)
    return target


def first_shard(directory: Path) -> Path:
    return sorted(directory.glob("*.safetensors"))[0]


def header_of(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def write_header(path: Path, header, data: bytes) -> None:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def edit_entry(path: Path, change) -> None:
    header, data = header_of(path)
    name = next(k for k in header if k != "__metadata__")
    change(header, name)
    write_header(path, header, data)


def edit_json(path: Path, change) -> None:
    data = json.loads(path.read_text())
    data = change(data)
    path.write_text(json.dumps(data))


def refused(directory: Path, *fragments: str) -> str:
    with pytest.raises(InputError) as info:
        check_checkpoint(directory)
    text = str(info.value)
    for f in fragments:
        assert f in text, text
    return text


HEADERS = {
    "a JSON list": (lambda h, n: [h[n]], "not a JSON object"),
    "a string": (lambda h, n: "tensors", "not a JSON object"),
    "an entry that is a list": (lambda h, n: {**h, n: [1, 2]}, "header entry must be a JSON object"),
    "offsets as strings": (lambda h, n: _set(h, n, "data_offsets", ["0", "8"]), "data_offsets"),
    "one offset": (lambda h, n: _set(h, n, "data_offsets", [0]), "data_offsets"),
    "negative offsets": (lambda h, n: _set(h, n, "data_offsets", [-8, 0]), "data_offsets"),
    "offsets as booleans": (lambda h, n: _set(h, n, "data_offsets", [False, True]), "data_offsets"),
    "reversed offsets": (lambda h, n: _set(h, n, "data_offsets", [8, 0]), "end before they begin"),
    "shape as strings": (lambda h, n: _set(h, n, "shape", ["4", "4"]), "shape"),
    "shape as a number": (lambda h, n: _set(h, n, "shape", 16), "shape"),
    "shape with a float": (lambda h, n: _set(h, n, "shape", [4.0, 4]), "shape"),
    "dtype a number": (lambda h, n: _set(h, n, "dtype", 16), "dtype must be a string"),
    "no dtype": (lambda h, n: _drop(h, n, "dtype"), "no dtype"),
    "metadata a list": (lambda h, n: {**h, "__metadata__": ["pt"]}, "__metadata__"),
}


def _set(header, name, key, value):
    header[name][key] = value
    return header


def _drop(header, name, key):
    del header[name][key]
    return header


@pytest.mark.parametrize("case", list(HEADERS))
def test_a_malformed_safetensors_header_is_named(qwen, case):
    change, fragment = HEADERS[case]
    shard = first_shard(qwen)
    header, data = header_of(shard)
    name = next(k for k in header if k != "__metadata__")
    write_header(shard, change(header, name), data)
    refused(qwen, fragment, str(shard))


INDEXES = {
    "weight_map a list": (lambda d: {**d, "weight_map": list(d["weight_map"])}, "weight_map"),
    "weight_map absent": (lambda d: {"metadata": {}}, "weight_map"),
    "index a list": (lambda d: [d], "must be a JSON object"),
    "a shard name that is a number": (lambda d: _first(d, 3), "weight_map"),
    "a shard outside the directory": (lambda d: _first(d, "../model.safetensors"), "not a file name"),
    "an empty shard name": (lambda d: _first(d, ""), "weight_map"),
}


def _first(index, value):
    name = next(iter(index["weight_map"]))
    index["weight_map"][name] = value
    return index


@pytest.mark.parametrize("case", list(INDEXES))
def test_a_malformed_index_is_named(qwen, case):
    change, fragment = INDEXES[case]
    edit_json(qwen / INDEX, change)
    refused(qwen, fragment, INDEX)


CONFIGS = {
    "hidden_size": "64",
    "num_hidden_layers": 2.0,
    "num_local_experts": True,
    "moe_intermediate_size": [32],
    "architectures": "Qwen3MoeForCausalLM",
    "model_type": 3,
    "decoder_sparse_step": "1",
    "mlp_only_layers": "0",
    "tie_word_embeddings": "false",
    "quantization_config": "mxfp4",
    "dtype": ["bfloat16"],
    "vocab_size": -1,
    "rms_norm_eps": "1e-6",
    "eos_token_id": "<|im_end|>",
}


@pytest.mark.parametrize("key", list(CONFIGS))
def test_a_config_field_of_the_wrong_type_is_named(qwen, key):
    edit_json(qwen / "config.json", lambda c: {**c, key: CONFIGS[key]})
    refused(qwen, "config.json", key)


def test_architectures_of_the_wrong_element_type_and_a_quant_method_that_is_not_a_string(qwen):
    edit_json(qwen / "config.json", lambda c: {**c, "architectures": [["Qwen3MoeForCausalLM"]]})
    refused(qwen, "architectures")
    edit_json(qwen / "config.json", lambda c: {**c, "architectures": ["Qwen3MoeForCausalLM"]})
    edit_json(qwen / "config.json", lambda c: {**c, "quantization_config": {"quant_method": 4}})
    refused(qwen, "quantization_config.quant_method")


def test_a_config_that_is_not_an_object_or_is_nested_without_bound(qwen):
    (qwen / "config.json").write_text("[1, 2]")
    refused(qwen, "must be a JSON object, got a JSON list")
    (qwen / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    refused(qwen, "nested deeper")


def test_generation_and_tokenizer_configs_are_typed(qwen):
    assert generation_eos_ids(qwen) is None  # the tiny one has no eos
    (qwen / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643]}))
    assert generation_eos_ids(qwen) == [151645, 151643]
    (qwen / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert generation_eos_ids(qwen) == [7]
    for bad in ("x", [1, "2"], [], {"id": 1}):
        (qwen / "generation_config.json").write_text(json.dumps({"eos_token_id": bad}))
        refused(qwen, "generation_config.json", "eos_token_id")
    (qwen / "generation_config.json").write_text("[]")
    refused(qwen, "generation_config.json", "JSON object")
    (qwen / "generation_config.json").unlink()
    (qwen / "chat_template.jinja").unlink()
    (qwen / "tokenizer_config.json").write_text(json.dumps({"chat_template": 5}))
    with pytest.raises(InputError, match=r"tokenizer_config\.json.*chat_template"):
        check_checkpoint(qwen, chat_template_for="org/Qwen-Instruct")


DRAFTER = {
    "architectures": ["DFlashDraftModel"],
    "hidden_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "vocab_size": 128,
    "rms_norm_eps": 1e-6,
    "dflash_config": {"target_layer_ids": [0], "mask_token_id": 3, "block_size": 8},
}


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({"attention_bias": "false"}, "attention_bias"),
        ({"architectures": 5}, "architectures"),
        ({"architectures": [["DFlashDraftModel"]]}, "architectures"),
        ({"hidden_act": ["silu"]}, "hidden_act"),
        ({"rms_norm_eps": "1e-6"}, "rms_norm_eps"),
        ({"vocab_size": 128.0}, "vocab_size"),
        ({"dflash_config": {"target_layer_ids": ["0"], "mask_token_id": 3}}, "target_layer_ids"),
        ({"dflash_config": {"target_layer_ids": [0], "mask_token_id": "3"}}, "mask_token_id"),
        ({"dflash_config": {"target_layer_ids": [0], "mask_token_id": 3, "block_size": 8.0}}, "block_size"),
    ],
)
def test_a_drafter_config_field_of_the_wrong_type_is_named(change, fragment):
    assert parse_drafter_config(DRAFTER, "d/config.json").block_size == 8
    with pytest.raises(InputError, match=fragment) as info:
        parse_drafter_config({**DRAFTER, **change}, "d/config.json")
    assert "d/config.json" in str(info.value)


def test_plan_names_a_malformed_checkpoint_and_exits_2(qwen, tmp_path, capsys):
    edit_json(qwen / INDEX, lambda d: {**d, "weight_map": list(d["weight_map"])})
    spec = tmp_path / "spec.yaml"
    model = {"id": "org/tiny", "path": str(qwen), "engine_options": {"drafter": "early_exit"}}
    data = {"name": "t", "models": [model], "baselines": ["B0"], "block_sizes": [4], "concurrency": [1]}
    spec.write_text(yaml.safe_dump(data))
    capsys.readouterr()
    assert main(["plan", str(spec)]) == 2
    err = capsys.readouterr().err
    assert "models.0" in err and INDEX in err and "weight_map" in err and "Traceback" not in err


@pytest.mark.parametrize("ref", [b"\xff\xfe", b"", b"../../etc", b"a/b"])
def test_a_hub_cache_ref_that_is_not_a_revision_is_named(tmp_path, ref):
    from pd_dflash.engine.reference.checkpoints.resolve import resolve

    repo = tmp_path / "hub" / "models--org--tiny"
    (repo / "snapshots" / "abc").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_bytes(ref)
    with pytest.raises(InputError, match="not a revision name") as err:
        resolve("org/tiny", env={"HF_HOME": str(tmp_path)})
    assert err.value.where == str(repo / "refs" / "main")


def test_a_chat_template_json_is_typed(qwen):
    (qwen / "chat_template.jinja").unlink()
    (qwen / "tokenizer_config.json").write_text("{}")
    (qwen / "chat_template.json").write_text(json.dumps({"chat_template": ["x"]}))
    with pytest.raises(InputError, match=r"chat_template\.json.*chat_template"):
        check_checkpoint(qwen, chat_template_for="org/Qwen-Instruct")
    (qwen / "chat_template.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    check_checkpoint(qwen, chat_template_for="org/Qwen-Instruct")
