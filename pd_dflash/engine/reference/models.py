"""Loading a target model (a trained preset, or a real checkpoint streamed from a local path / the HF cache by
``checkpoints.loader``) and making its prompts (the preset's synthetic language, or a prompt file through the
checkpoint's tokenizer)."""

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
    #: A checkpoint's host store (its experts are streamed into it at load; a preset's are moved into one by the
    #: engine), its storage ("bf16", "mxfp4", ...), and the load's refusal when the store or the weights would
    #: not fit (the model is then the ``meta`` skeleton: every cell is refused with the figures).
    store: Any = None
    storage: str | None = None
    refusal: Any = None
    #: An instruct target: its prompts go through the tokenizer's chat template (``prompts.py``).
    chat: bool = False

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Every id of a checkpoint's ``generation_config.eos_token_id`` (an id or a list: Qwen3 lists 151645
        and 151643); each of them stops a request. A preset has none (its requests run to max_new_tokens)."""
        config = getattr(self.model, "generation_config", None) if self.source == "checkpoint" else None
        eos = getattr(config, "eos_token_id", None)
        if eos is None:
            return frozenset()
        return frozenset(int(t) for t in ([eos] if isinstance(eos, int) else eos))


def load_model(
    model_id: str,
    preset: str | None,
    *,
    seed: int,
    cache_dir: str | None,
    dtype: str,
    path: str | None = None,
    device: torch.device | None = None,
    storage: str = "auto",
    host_available_bytes: int | None = None,
    device_available_bytes: int | None = None,
) -> LoadedModel:
    """A preset when ``preset`` is set (or ``model_id`` names one), loaded on CPU (the engine moves its experts
    into a host store); else a real checkpoint, streamed: non-expert weights on ``device``, experts into the
    host store as stored, after checking both fit (``*_available_bytes``; None: not checked)."""
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
    from pd_dflash.engine.reference.checkpoints.loader import load_checkpoint

    device = device or torch.device("cpu")
    loaded = load_checkpoint(
        model_id,
        path,
        device=device,
        dtype=dtype,
        storage=storage,
        pin=device.type == "cuda",
        cache_dir=cache_dir,
        host_available_bytes=host_available_bytes,
        device_available_bytes=device_available_bytes,
    )
    return LoadedModel(
        loaded.model,
        loaded.family,
        "checkpoint",
        model_id,
        tokenizer=loaded.tokenizer,
        card=loaded.card,
        store=loaded.store,
        storage=loaded.card["storage"],
        refusal=loaded.refusal,
        chat=needs_chat_template(model_id, loaded.family),
    )


def make_prompts(
    loaded: LoadedModel, source: str, n: int, prompt_tokens: int, seed: int, chat_date: str | None = None
) -> list[list[int]]:
    """``n`` prompts (token ids), deterministic in ``seed``.

    "synthetic": sequences of the preset's language (for a checkpoint: ids drawn from a language over the
    first tokens of its vocabulary — runnable, not meaningful text). Text prompts (``humaneval``, ``file:PATH``,
    a plain file; ``prompts.py``) go through the checkpoint's tokenizer, its chat template for an instruct
    target, rendered with the fixed ``chat_date``; a preset's plain file holds token ids. Chosen by a seeded
    permutation, cycled to ``n``.
    """
    if source == "synthetic":
        lang = loaded.language or _fallback_language(loaded.model.config.vocab_size)
        return [row.tolist() for row in lang.sample(n, max(2, prompt_tokens), seed=[seed, 7])]
    vocab = loaded.model.config.vocab_size
    if loaded.tokenizer is not None:
        where = str(Path(loaded.tokenizer.name_or_path) / "tokenizer_config.json")
        texts = load_prompt_texts(source)
        prompts = encode_prompts(
            texts,
            loaded.tokenizer,
            chat=loaded.chat,
            source=source,
            where=where,
            vocab_size=vocab,
            date=chat_date,
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
