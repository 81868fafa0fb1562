"""The files every tiny real-layout checkpoint has, whatever its family (no torch at import): a character-level
tokenizer of ``VOCAB`` tokens with the family's special tokens and chat template, and safetensors shards with
an index like a multi-file hub checkpoint. Each family's writer (``families/<family>.py``: ``write_tiny``) adds
its config and weights; ``tiny.py`` caches the results.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

VOCAB = 128
#: Characters the tokenizers know (one token each), after the special tokens.
_CHARS = [chr(c) for c in range(32, 127)] + ["\n", "\t"]
#: The config fields every tiny checkpoint shares (a family's writer adds its own).
COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts_per_tok=2,
    tie_word_embeddings=False,
)


def write_tokenizer(path: Path, specials: list[str], template: str, eos: str) -> dict[str, int]:
    """A character-level tokenizer of ``VOCAB`` tokens (specials first) with a chat template; returns ids."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    names = specials + _CHARS + ["[UNK]"]
    names += [f"<|reserved_{i}|>" for i in range(VOCAB - len(names))]
    vocab = {name: i for i, name in enumerate(names)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="[UNK]"))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        eos_token=eos,
        pad_token=specials[0],
        additional_special_tokens=specials,
    )
    fast.chat_template = template
    fast.save_pretrained(str(path))
    return vocab


def save_sharded(state: dict[str, torch.Tensor], path: Path) -> None:
    """Two shards (layer 0 + embeddings, the rest) and the index, as a multi-file hub checkpoint has."""
    from safetensors.torch import save_file

    shards: dict[str, dict[str, torch.Tensor]] = {}
    for name in sorted(state):
        first = name.startswith(("model.embed_tokens", "model.layers.0."))
        shards.setdefault(
            "model-00001-of-00002.safetensors" if first else "model-00002-of-00002.safetensors", {}
        )[name] = state[name]
    for file, tensors in shards.items():
        save_file(tensors, str(path / file), metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": {n: f for f, ts in shards.items() for n in ts}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
