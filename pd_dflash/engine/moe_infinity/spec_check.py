"""Plan-time check of a MoE-Infinity spec, without torch or the library: each model whose checkpoint is visible
from here (``models[].path``, a local directory, or the Hugging Face cache) keeps its longest prompt +
``max_new_tokens`` + B within its ``config.json`` ``max_position_embeddings`` (the rule of
``spec_inputs.positions_problem``). The adapter's prompts (``prompts.py``) are windows of exactly
``workload.prompt_tokens`` tokens, or a plain file's lines through the tokenizer without special tokens, so the
count is exact. A checkpoint not here: nothing to check on this machine (the library loads it on the boxes).
"""

from __future__ import annotations

import os
from typing import Any

from pd_dflash.engine.reference.checkpoints.fields import read_json_object
from pd_dflash.engine.reference.checkpoints.resolve import resolve
from pd_dflash.engine.reference.positions import PromptLength, PromptTexts, check_positions, encoder


def check_spec(spec: Any) -> list[str]:
    """Refuse (InputError at ``models.N``) a model whose visible checkpoint cannot hold the spec's longest cell."""
    env = {**os.environ, **spec.env}
    texts = PromptTexts(spec.workload.prompts)
    for i, m in enumerate(spec.models):
        found = resolve(m.id, m.path, env=env)
        config_path = found.directory / "config.json" if found.directory is not None else None
        if config_path is None or not config_path.is_file():
            continue
        positions = read_json_object(config_path).get("max_position_embeddings")
        if not isinstance(positions, int) or isinstance(positions, bool) or positions < 1:
            continue
        length = _prompt_length(spec, found.directory, texts)
        check_positions(spec, i, m.id, positions, f"max_position_embeddings in {config_path}", length)
    return []


def _prompt_length(spec: Any, directory, texts: PromptTexts) -> PromptLength | None:
    if spec.workload.prompts == "synthetic":
        return PromptLength(spec.workload.prompt_tokens)
    found = texts.texts()
    encode = encoder(directory / "tokenizer.json")
    if not found or encode is None:
        return None
    return PromptLength(max(encode(t) for t in found))
