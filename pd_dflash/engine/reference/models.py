"""Loading a target model (a trained preset, or a real checkpoint from a local path / the HF cache) and
making its prompts (the preset's synthetic language, or a prompt file through the checkpoint's tokenizer)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pd_dflash.engine.reference.families import MoEFamily, family_of
from pd_dflash.engine.reference.presets.catalog import PRESETS, get_preset
from pd_dflash.engine.reference.presets.language import SyntheticLanguage
from pd_dflash.engine.reference.presets.training import load_preset
from pd_dflash.engine.reference.prompts import (
    check_prompt_source,
    encode_prompts,
    load_prompt_texts,
    needs_chat_template,
    prompt_kind,
    select,
)
from pd_dflash.errors import InputError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class LoadedModel:
    model: nn.Module
    family: MoEFamily
    #: "preset" or "checkpoint"
    source: str
    name: str
    language: SyntheticLanguage | None = None
    tokenizer: Any = None
    card: dict[str, Any] = field(default_factory=dict)
    #: An instruct target: its prompts go through the tokenizer's chat template (``prompts.py``).
    chat: bool = False

    @property
    def eos_token_id(self) -> int | None:
        eos = (
            getattr(self.model.generation_config, "eos_token_id", None)
            if self.source == "checkpoint"
            else None
        )
        return eos[0] if isinstance(eos, list) and eos else eos


def load_model(
    model_id: str, preset: str | None, *, seed: int, cache_dir: str | None, dtype: str
) -> LoadedModel:
    """A preset when ``preset`` is set (or ``model_id`` names one), else a checkpoint, loaded on CPU."""
    name = preset or (model_id if model_id in PRESETS else None)
    if name is not None:
        try:
            p = get_preset(name)
        except KeyError as exc:
            raise InputError(str(exc.args[0]), where="models[].preset") from None
        model, card = load_preset(p, seed=seed, cache_dir=cache_dir)
        if dtype not in ("auto", "fp32"):
            model = model.to(DTYPES[dtype])
        return LoadedModel(model, family_of(model.config), "preset", name, language=p.language, card=card)
    return load_checkpoint(model_id, dtype=dtype)


def load_checkpoint(path_or_id: str, *, dtype: str = "auto") -> LoadedModel:
    """A real MoE checkpoint, strictly offline (``local_files_only=True``): a directory or an HF cache entry."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(path_or_id, local_files_only=True)
    except OSError as exc:
        raise InputError(
            f"cannot load checkpoint {path_or_id!r} offline: {exc}. Use a local directory or a model already in "
            "the HF cache, or set models[].preset to a reference preset "
            f"({', '.join(PRESETS)})",
            where="models[].id",
        ) from None
    try:
        family = family_of(config)
    except ValueError as exc:
        raise InputError(str(exc), where="models[].id") from None
    torch_dtype = "auto" if dtype == "auto" else DTYPES[dtype]
    model = AutoModelForCausalLM.from_pretrained(path_or_id, local_files_only=True, dtype=torch_dtype)
    tokenizer = None
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path_or_id, local_files_only=True)
    except (OSError, ValueError, TypeError):
        tokenizer = None  # prompts must then be synthetic token ids
    card = {"checkpoint": str(path_or_id), "model_type": config.model_type}
    chat = needs_chat_template(str(path_or_id), config.model_type)
    return LoadedModel(
        model.eval(), family, "checkpoint", str(path_or_id), tokenizer=tokenizer, card=card, chat=chat
    )


def make_prompts(loaded: LoadedModel, source: str, n: int, prompt_tokens: int, seed: int) -> list[list[int]]:
    """``n`` prompts (token ids), deterministic in ``seed``.

    "synthetic": sequences of the preset's language (for a checkpoint: ids drawn from a language over the
    first tokens of its vocabulary — runnable, not meaningful text). Text prompts (``humaneval``, ``file:PATH``,
    a plain file; ``prompts.py``) go through the checkpoint's tokenizer, its chat template for an instruct
    target; a preset's plain file holds token ids. Chosen by a seeded permutation, cycled to ``n``.
    """
    if source == "synthetic":
        lang = loaded.language or _fallback_language(loaded.model.config.vocab_size)
        return [row.tolist() for row in lang.sample(n, max(2, prompt_tokens), seed=[seed, 7])]
    vocab = loaded.model.config.vocab_size
    if loaded.tokenizer is not None:
        where = str(Path(loaded.tokenizer.name_or_path) / "tokenizer_config.json")
        texts = load_prompt_texts(source)
        prompts = encode_prompts(
            texts, loaded.tokenizer, chat=loaded.chat, source=source, where=where, vocab_size=vocab
        )
    elif prompt_kind(source) == "lines":
        prompts = _token_id_lines(source, vocab)
    else:
        check_prompt_source(source, has_tokenizer=False, model=loaded.name)
    return select(prompts, n, seed)


def _token_id_lines(source: str, vocab: int) -> list[list[int]]:
    """A plain prompt file for a model without a tokenizer (a preset): whitespace-separated token ids."""
    prompts = []
    for i, line in enumerate(load_prompt_texts(source)):
        try:
            ids = [int(tok) for tok in line.split()]
        except ValueError:
            raise InputError(
                f"{source}:{i + 1}: this model has no tokenizer, so prompt lines must be token ids",
                where="workload.prompts",
            ) from None
        if any(t < 0 or t >= vocab for t in ids):
            raise InputError(
                f"{source}:{i + 1}: prompt has ids outside [0, {vocab})", where="workload.prompts"
            )
        prompts.append(ids)
    return prompts


def _fallback_language(vocab_size: int) -> SyntheticLanguage:
    return SyntheticLanguage(modes=1, mode_vocab=min(vocab_size, 256), switch_p=0.0)
