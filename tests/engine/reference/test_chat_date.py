"""Chat templates render a FIXED date (issue 22, item 4): gpt-oss's harmony template puts
``strftime_now("%Y-%m-%d")`` — the run's date — into its system message, so prompt token ids differed between
days and between the boxes of a sweep that crosses midnight. The date now comes from the spec
(``workload.chat_date``, a fixed default), and the row records it."""

from __future__ import annotations

import datetime

import pytest

from pd_dflash.engine.reference.checkpoints.tiny import materialise
from pd_dflash.engine.reference.prompts import encode_prompts, fixed_date_template, prompt_facts
from pd_dflash.errors import InputError
from pd_dflash.spec import Workload
from pd_dflash.spec_inputs import DEFAULT_CHAT_DATE

#: The shape of openai/gpt-oss-20b's harmony template around the date (system message, then the chat).
HARMONY_DATED = (
    '{%- if strftime_now is defined %}{%- set today = strftime_now("%Y-%m-%d") %}{%- endif %}'
    "<|start|>system<|message|>Knowledge cutoff: 2024-06\nCurrent date: {{ today }} "
    "({{ strftime_now('%d %b %Y') }})<|end|>"
    "{%- for message in messages %}<|start|>{{ message.role }}<|message|>{{ message.content }}<|end|>"
    "{%- endfor %}{%- if add_generation_prompt %}<|start|>assistant{%- endif %}"
)


@pytest.fixture(scope="module")
def harmony():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(materialise("tiny-real-gpt-oss")))
    tok.chat_template = HARMONY_DATED
    return tok


def rendered(tok, date):
    [ids] = encode_prompts(["hi"], tok, chat=True, source="file:x", where="t", vocab_size=len(tok), date=date)
    return tok.decode(ids).replace(" ", "")


def test_the_template_renders_the_spec_date_not_the_clock(harmony):
    today = datetime.date.today()
    text = rendered(harmony, "2026-01-31")
    assert "Currentdate:2026-01-31(31Jan2026)" in text
    assert today.isoformat() not in text or today.isoformat() == "2026-01-31"
    default = rendered(harmony, None)
    assert f"Currentdate:{DEFAULT_CHAT_DATE}" in default
    assert rendered(harmony, None) == default  # the same prompt ids on every call, day and box


def test_fixed_date_template_replaces_every_literal_call_and_refuses_others():
    fixed = fixed_date_template("{{ strftime_now( '%Y' ) }}/{{ strftime_now(\"%m-%d\") }}", "2025-08-05", "t")
    assert fixed == '{{ "2025" }}/{{ "08-05" }}'
    assert fixed_date_template("{% if strftime_now is defined %}x{% endif %}", "2025-08-05", "t") == (
        "{% if strftime_now is defined %}x{% endif %}"
    )
    with pytest.raises(InputError, match="not a string literal") as err:
        fixed_date_template("{{ strftime_now(fmt) }}", "2025-08-05", "tok/tokenizer_config.json")
    assert err.value.where == "tok/tokenizer_config.json"


def test_the_row_records_the_date_a_chat_template_rendered():
    dated = Workload(prompts="humaneval", chat_date="2026-01-31")
    assert prompt_facts(dated, True, [])["chat_date"] == "2026-01-31"
    assert prompt_facts(Workload(prompts="humaneval"), True, [])["chat_date"] == DEFAULT_CHAT_DATE
    assert "chat_date" not in prompt_facts(Workload(), False, [])
