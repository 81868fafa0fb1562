"""Helpers for the MoE-Infinity contract tests: the fake package, a local tokenizer, specs, contexts, engines
and rows."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

from pd_dflash.engine.interface import Engine, EngineContext, Refused
from pd_dflash.engine.moe_infinity.engine import MoEInfinityEngine
from pd_dflash.engine.moe_infinity.prompts import SYNTHETIC_TEXTS
from pd_dflash.engine.registry import check
from pd_dflash.schema import EngineResult, Row
from pd_dflash.spec import Cell, SweepSpec, expand, parse_spec

REPO = Path(__file__).resolve().parents[3]
FAKE_ROOT = Path(__file__).resolve().parent / "fake_moe_infinity"
MODEL = "fake/tiny-moe"
DRAFT = "fake/tiny-moe-dflash"
#: A short workload for the contract tests (the ``spec`` fixture of conftest.py).
SMALL = {"workload": {"requests": 4, "warmup_rounds": 1, "max_new_tokens": 16, "prompt_tokens": 10}}


def make_tokenizer(directory: Path) -> Path:
    """A word-level tokenizer over the synthetic prompt texts, saved for ``AutoTokenizer`` (offline)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words: dict[str, int] = {"[UNK]": 0}
    splitter = pre_tokenizers.Whitespace()
    for text in SYNTHETIC_TEXTS:
        for word, _ in splitter.pre_tokenize_str(text):
            words.setdefault(word, len(words))
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="[UNK]"))
    tok.pre_tokenizer = splitter
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(str(directory))
    return directory


def spec_data(tmp_path: Path, tokenizer: Path, **overrides: Any) -> dict[str, Any]:
    options = {"tokenizer": str(tokenizer), "expert_byte_budget": 32_000_000}
    options.update(overrides.pop("engine_options", {}))
    data: dict[str, Any] = {
        "name": "fake-moe",
        "engine": "moe_infinity",
        "models": [
            {
                "id": MODEL,
                "draft": DRAFT,
                "offload_dir": str(tmp_path / "offload"),
                "engine_options": options,
            }
        ],
        "baselines": ["B0", "B1", "B2", "B3", "OURS"],
        "block_sizes": [4, 8],
        "concurrency": [1, 3],
        "repeats": 1,
        "workload": {"requests": 6, "warmup_rounds": 1, "max_new_tokens": 24, "prompt_tokens": 12},
        "hardware": {"device": "cpu"},
        "env": {"MOE_DISABLE_CUDA_GRAPHS": "1", "HF_HUB_OFFLINE": "1"},
    }
    data.update(overrides)
    return data


def make_spec(tmp_path: Path, tokenizer: Path, **overrides: Any) -> SweepSpec:
    return check(parse_spec(spec_data(tmp_path, tokenizer, **overrides)))


def context(spec: SweepSpec, load_group: str = "shared") -> EngineContext:
    return EngineContext.for_model(spec, device="cpu", load_group=load_group)


def cell(spec: SweepSpec, baseline: str, block_size: int | None = None, concurrency: int = 1) -> Cell:
    for c in expand(spec):
        if c.baseline == baseline and c.concurrency == concurrency and block_size in (None, c.block_size):
            return c
    raise LookupError((baseline, block_size, concurrency))


def stored_row(
    spec: SweepSpec, baseline: str, block_size: int, concurrency: int, result: EngineResult
) -> Row:
    """The stored row, validated exactly as the runner does it."""
    return Row.from_result(cell(spec, baseline, block_size, concurrency), result)


def import_fake(monkeypatch, disable: tuple[str, ...] = (), faults: tuple[str, ...] = ()):
    """A freshly imported fake package with the given surface, and the adapter's per-process guard cleared."""
    from pd_dflash.engine.moe_infinity import loading

    monkeypatch.setenv("FAKE_MOE_INFINITY_DISABLE", ",".join(disable))
    monkeypatch.setenv("FAKE_MOE_INFINITY_FAULTS", ",".join(faults))
    monkeypatch.syspath_prepend(str(FAKE_ROOT))
    for name in [n for n in sys.modules if n == "moe_infinity" or n.startswith("moe_infinity.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(loading, "_PROCESS_LOAD", None)
    module = importlib.import_module("moe_infinity")
    assert module.__fake__ is True
    return module


def run(engine: Engine, cell: Cell) -> EngineResult:
    """``engine.run_cell`` as the runner sees it: a ``Refused`` becomes a result with its status and reason."""
    try:
        return engine.run_cell(cell)
    except Refused as refusal:
        return EngineResult(status=refusal.status, reason=refusal.reason, engine=engine.describe())


def fake_engine(monkeypatch, spec: SweepSpec, load_group: str = "shared", disable=(), faults=()):
    """(the freshly imported fake package, an adapter over it): ``import_fake``'s surface, then the engine."""
    fake = import_fake(monkeypatch, disable=disable, faults=faults)
    return fake, MoEInfinityEngine(context(spec, load_group))
