"""Loading a target model (a trained preset, or a real checkpoint streamed from a local path / the HF cache by
``checkpoints.loader``) and making its prompts (the preset's synthetic language, or a prompt file through the
checkpoint's tokenizer)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from pd_dflash.engine.reference.families import MoEFamily, family_of
from pd_dflash.engine.reference.offload import install_offload
from pd_dflash.engine.reference.presets.catalog import PRESETS, get_preset
from pd_dflash.engine.reference.presets.language import SyntheticLanguage
from pd_dflash.engine.reference.presets.training import load_preset
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
    #: The host expert store (a checkpoint's experts are streamed into it; a preset's are moved into it).
    store: Any = None

    @property
    def eos_token_id(self) -> int | None:
        eos = (
            getattr(self.model.generation_config, "eos_token_id", None)
            if self.source == "checkpoint"
            else None
        )
        return eos[0] if isinstance(eos, list) and eos else eos


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
    chat_template: bool = False,
) -> LoadedModel:
    """The target on ``device`` with its routed experts in a host store (pinned on CUDA): a preset when
    ``preset`` is set (or ``model_id`` names one), its experts moved into the store in ``storage`` ("auto": the
    compute dtype); else a real checkpoint, streamed (experts stored as the checkpoint stores them)."""
    device = device or torch.device("cpu")
    name = preset or (model_id if model_id in PRESETS else None)
    if name is not None:
        try:
            p = get_preset(name)
        except KeyError as exc:
            raise InputError(str(exc.args[0]), where="models[].preset") from None
        model, card = load_preset(p, seed=seed, cache_dir=cache_dir)
        if dtype not in ("auto", "fp32"):
            model = model.to(DTYPES[dtype])
        family = family_of(model.config)
        if storage == "auto":
            storage = {v: k for k, v in DTYPES.items()}[next(model.parameters()).dtype]
        store = install_offload(model, family, storage, pin=device.type == "cuda")
        model.to(device)  # everything but the routed experts, which now live in the host store
        return LoadedModel(model, family, "preset", name, language=p.language, card=card, store=store)
    from pd_dflash.engine.reference.checkpoints.loader import load_checkpoint

    loaded = load_checkpoint(
        model_id,
        path,
        device=device,
        dtype=dtype,
        storage=storage,
        pin=device.type == "cuda",
        cache_dir=cache_dir,
        chat_template=chat_template,
    )
    return LoadedModel(
        loaded.model,
        loaded.family,
        "checkpoint",
        model_id,
        tokenizer=loaded.tokenizer,
        card=loaded.card,
        store=loaded.store,
    )


def make_prompts(loaded: LoadedModel, source: str, n: int, prompt_tokens: int, seed: int) -> list[list[int]]:
    """``n`` prompts (token ids), deterministic in ``seed``.

    "synthetic": sequences of the preset's language (for a checkpoint: ids drawn from a language over the
    first tokens of its vocabulary — runnable, not meaningful text). A file: one prompt per non-empty line,
    through the checkpoint's tokenizer (presets: whitespace-separated token ids), cycled to ``n`` prompts.
    """
    if source == "synthetic":
        lang = loaded.language or _fallback_language(loaded.model.config.vocab_size)
        return [row.tolist() for row in lang.sample(n, max(2, prompt_tokens), seed=[seed, 7])]
    path = Path(source)
    try:
        lines = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    except OSError as exc:
        raise InputError(
            f"cannot read prompt file: {exc.strerror or exc}", where="workload.prompts"
        ) from None
    if not lines:
        raise InputError(f"prompt file {source} has no prompt", where="workload.prompts")
    vocab = loaded.model.config.vocab_size
    prompts = []
    for i, line in enumerate(lines):
        if loaded.tokenizer is not None:
            ids = loaded.tokenizer(line, add_special_tokens=True)["input_ids"]
        else:
            try:
                ids = [int(tok) for tok in line.split()]
            except ValueError:
                raise InputError(
                    f"{source}:{i + 1}: this model has no tokenizer, so prompt lines must be token ids",
                    where="workload.prompts",
                ) from None
        if not ids or any(t < 0 or t >= vocab for t in ids):
            raise InputError(
                f"{source}:{i + 1}: prompt is empty or has ids outside [0, {vocab})", where="workload.prompts"
            )
        prompts.append(ids)
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(prompts))
    return [prompts[order[i % len(prompts)]] for i in range(n)]


def _fallback_language(vocab_size: int) -> SyntheticLanguage:
    return SyntheticLanguage(modes=1, mode_vocab=min(vocab_size, 256), switch_p=0.0)
