"""Loading a published DFlash drafter (``config.json`` + safetensors, z-lab's tensor names) onto its target.

The config is parsed twice: by ``config.parse_drafter_config`` (the drafter's own fields, checked against the
target) and by transformers' ``Qwen3Config`` (as the official package does), which decides the RoPE
(``rope_parameters``, every rope type) and each layer's attention rule (``layer_types``, ``sliding_window``,
``is_causal``). Every tensor the architecture needs must be present with the shape the config implies; a missing
or misshapen tensor is an InputError naming the file and the tensor. Tensors the drafter does not use (e.g. an
``embed_tokens`` copy) are ignored and listed in the facts.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pd_dflash.engine.reference.checkpoints.fields import read_weight_map
from pd_dflash.engine.reference.dflash.config import (
    DFlashConfig,
    drafter_problems,
    parse_drafter_config,
    read_json,
)
from pd_dflash.engine.reference.dflash.model import DFlashDrafter
from pd_dflash.errors import InputError

INDEX_FILE = "model.safetensors.index.json"


def layer_rules(hf_config: Any, layers: int) -> list[tuple[bool, int | None]]:
    """(causal, sliding window) per drafter layer, by the official rule: a layer is causal when it is a
    sliding layer, unless ``is_causal`` says otherwise; only sliding layers have a window."""
    types = getattr(hf_config, "layer_types", None)
    is_causal = getattr(hf_config, "is_causal", None)
    rules = []
    for i in range(layers):
        kind = types[i] if types else "full_attention"
        causal = kind == "sliding_attention" if is_causal is None else bool(is_causal)
        rules.append((causal, hf_config.sliding_window if kind == "sliding_attention" else None))
    return rules


def read_tensors(directory: Path) -> dict[str, tuple[torch.Tensor, Path]]:
    """Every tensor of the drafter's safetensors file(s), with the file it came from."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    index = directory / INDEX_FILE
    if index.is_file():
        files = sorted(set(read_weight_map(index).values()))
    else:
        files = [p.name for p in sorted(directory.glob("*.safetensors"))]
    if not files:
        raise InputError("no safetensors weights next to config.json", where=str(directory))
    out: dict[str, tuple[torch.Tensor, Path]] = {}
    for name in files:
        path = directory / name
        try:
            tensors = load_file(str(path))
        except (OSError, SafetensorError) as exc:
            raise InputError(f"cannot read drafter weights: {exc}", where=str(path)) from None
        out.update({k: (t, path) for k, t in tensors.items()})
    if out and all(k.startswith("model.") for k in out):
        out = {k[len("model.") :]: v for k, v in out.items()}
    return out


def build_drafter(raw: Mapping[str, Any], cfg: DFlashConfig) -> DFlashDrafter:
    """The drafter a published ``config.json`` describes (``cfg``: its parsed fields), weights not yet loaded:
    the RoPE and each layer's attention rule come from transformers' ``Qwen3Config`` of the same file."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    hf = Qwen3Config.from_dict(dict(raw))
    return DFlashDrafter(cfg, Qwen3RotaryEmbedding(hf), layer_rules(hf, cfg.num_hidden_layers))


def load_dflash_drafter(
    directory: Path, target: nn.Module, *, target_where: str = "target config.json"
) -> tuple[DFlashDrafter, dict[str, Any]]:
    """The drafter in ``directory`` on ``target``'s device and dtype, borrowing its embedding and lm_head;
    InputError when it does not fit the target or its files are incomplete."""
    where = str(directory / "config.json")
    raw = read_json(directory / "config.json")
    cfg = parse_drafter_config(raw, where)
    problems = drafter_problems(target.config.to_dict(), cfg, target_where=target_where, drafter_where=where)
    if problems:
        raise InputError(
            "the drafter does not fit its target: " + "; ".join(problems), where="models[].draft"
        )
    drafter = build_drafter(raw, cfg)
    stored = read_tensors(directory)
    state = {}
    for name, expected in drafter.state_dict().items():
        if name not in stored:
            raise InputError(f"tensor {name!r} is missing from the drafter's weights", where=str(directory))
        tensor, path = stored[name]
        if tuple(tensor.shape) != tuple(expected.shape):
            raise InputError(
                f"tensor {name!r} is {list(tensor.shape)}, expected {list(expected.shape)} from config.json",
                where=str(path),
            )
        state[name] = tensor
    drafter.load_state_dict(state)
    param = next(target.parameters())
    drafter = drafter.to(device=param.device, dtype=param.dtype).eval()
    head = getattr(target, "lm_head", None) or target.get_output_embeddings()
    drafter.attach_target(target.get_input_embeddings().weight, head)
    facts = {
        "kind": "dflash",
        "checkpoint": str(directory),
        "architecture": "DFlashDraftModel",
        "layers": cfg.num_hidden_layers,
        "heads": cfg.num_attention_heads,
        "kv_heads": cfg.num_key_value_heads,
        "target_layer_ids": list(cfg.target_layer_ids),
        "mask_token_id": cfg.mask_token_id,
        "trained_block_size": cfg.block_size,
        "attention": ["sliding" if w else "causal" if c else "non-causal" for c, w in drafter_rules(drafter)],
        "params": sum(p.numel() for p in drafter.parameters()),
        "dtype": str(param.dtype).replace("torch.", ""),
        "ignored_tensors": sorted(set(stored) - set(state)),
        "runs": "resident (dense, no routed experts)",
    }
    return drafter, facts


def drafter_rules(drafter: DFlashDrafter) -> list[tuple[bool, int | None]]:
    return [(layer.self_attn.causal, layer.self_attn.window) for layer in drafter.layers]
