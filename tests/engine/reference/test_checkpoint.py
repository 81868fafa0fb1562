"""Real checkpoints: loaded offline (local_files_only) from a directory a test writes with save_pretrained."""

from __future__ import annotations

import pytest

from pd_dflash.errors import InputError
from pd_dflash.schema import Row, Status
from pd_dflash.spec import expand
from tests.engine.reference.helpers import make_engine, make_spec, tiny_model

#: A minimal chat template: gpt-oss targets are instruct models, prompted through their tokenizer's template.
CHAT_TEMPLATE = (
    "{% for m in messages %}w1 {{ m['content'] }} w2 {% endfor %}{% if add_generation_prompt %}w3{% endif %}"
)


def save_tokenizer(path, vocab_size, chat_template=CHAT_TEMPLATE):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(vocab_size - 1)}
    vocab["[UNK]"] = vocab_size - 1
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    fast.chat_template = chat_template
    fast.save_pretrained(str(path))


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_engine_runs_a_saved_checkpoint_with_a_prompt_file(tmp_path, family):
    ckpt = tmp_path / "ckpt"
    tiny_model(family).save_pretrained(str(ckpt))
    save_tokenizer(ckpt, 64)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("w1 w2 w3 w4 w5 w6\n\nw7 w8 w9 w10\nw11 w12 w13 w14 w15\n")
    spec = make_spec(
        # B3 is speculative (every expert resident): a checkpoint has no trained DFlash drafter, so early exit.
        model={"id": str(ckpt), "engine_options": {"drafter": "early_exit"}},
        concurrency=[2],
        workload={"requests": 3, "warmup_rounds": 0, "max_new_tokens": 6, "prompts": str(prompts), "seed": 1},
    )
    engine = make_engine(spec)
    assert engine.describe()["model_source"] == "checkpoint" and engine.loaded.tokenizer is not None
    rows = {c.baseline: Row.from_result(c, engine.run_cell(c)) for c in expand(spec)}
    assert rows["B0"].status == rows["B3"].status == Status.OK
    assert rows["B0"].engine["output_digest"] == rows["B3"].engine["output_digest"]
    assert rows["B0"].cost_terms.h2d_bytes > 0


def test_missing_checkpoint_is_a_clear_input_error(tmp_path):
    with pytest.raises(InputError, match="offline"):
        make_engine(make_spec(model={"id": str(tmp_path / "nowhere")}))
