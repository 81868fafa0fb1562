"""Tiny random DFlash drafters in z-lab's published layout, generated for a given target.

``config.json`` is a Qwen3 config with ``architectures: ["DFlashDraftModel"]``, ``num_target_layers`` and
``dflash_config {target_layer_ids, mask_token_id, block_size}``; ``model.safetensors`` holds the published tensor
names (``fc``, ``hidden_norm``, ``norm``, ``layers.{i}.self_attn.{q,k,v,o}_proj``, ``q_norm``/``k_norm``,
``layers.{i}.mlp.{gate,up,down}_proj``, the two layer norms). Weights come from a seeded CPU generator in float32
(then cast), so a seed gives the same drafter whatever the transformers version: tests, the parity fixture
(``scripts/dflash_parity.py``) and ``draft: tiny-real-dflash`` (generated into the engine cache on first use)
rely on that. A random drafter's acceptance is ≈ 1 token per round: it tests machinery, not speed.

``save_drafter`` is the layout's one writer: the tiny generator and the presets' trained drafters
(``presets/drafters.py``) write their directories through it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from pd_dflash.engine.reference.dflash.config import TINY_DRAFTER, DFlashConfig, parse_drafter_config

GENERATOR_VERSION = 1
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def published_tensor_shapes(cfg: DFlashConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a published drafter checkpoint and its shape, from the config alone."""
    h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    shapes = {
        "fc.weight": (h, len(cfg.target_layer_ids) * h),
        "hidden_norm.weight": (h,),
        "norm.weight": (h,),
    }
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, q),
                p + "self_attn.q_norm.weight": (d,),
                p + "self_attn.k_norm.weight": (d,),
                p + "mlp.gate_proj.weight": (inter, h),
                p + "mlp.up_proj.weight": (inter, h),
                p + "mlp.down_proj.weight": (h, inter),
            }
        )
        if cfg.attention_bias:
            shapes.update(
                {p + f"self_attn.{n}_proj.bias": (s,) for n, s in (("q", q), ("k", kv), ("v", kv), ("o", h))}
            )
    return shapes


def tiny_drafter_config(
    target: Mapping[str, Any],
    *,
    layers: int = 1,
    block_size: int = 8,
    target_layer_ids: list[int] | None = None,
    mask_token_id: int | None = None,
    **overrides: Any,
) -> dict[str, Any]:
    """A published-layout drafter ``config.json`` sized for ``target`` (a target ``config.json`` dict)."""
    h, vocab, depth = int(target["hidden_size"]), int(target["vocab_size"]), int(target["num_hidden_layers"])
    heads = next(n for n in (4, 2, 1) if h % n == 0 and (h // n) % 2 == 0)
    if target_layer_ids is None:
        k = min(depth, 3)
        target_layer_ids = sorted({round(i * (depth - 1) / max(1, k - 1)) for i in range(k)})
    config = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": h,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads // 2 if heads > 1 else 1,
        "head_dim": h // heads,
        "intermediate_size": 2 * h,
        "hidden_act": "silu",
        "vocab_size": vocab,
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "max_position_embeddings": int(target.get("max_position_embeddings", 4096)),
        "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0},
        "tie_word_embeddings": False,
        "num_target_layers": depth,
        "dtype": _dtype_name(target),
        "dflash_config": {
            "target_layer_ids": list(target_layer_ids),
            "mask_token_id": vocab - 1 if mask_token_id is None else mask_token_id,
            "block_size": block_size,
        },
    }
    config.update(overrides)
    return config


def write_tiny_drafter(out: Path, config: Mapping[str, Any], *, seed: int = 0) -> Path:
    """Write ``config.json`` + seeded random ``model.safetensors`` into ``out`` (created); returns ``out``."""
    cfg = parse_drafter_config(config, str(out / "config.json"))
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in sorted(published_tensor_shapes(cfg).items()):
        if name.endswith("norm.weight"):  # jittered around 1: a norm the drafter ignored would show
            t = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif name.endswith(".bias"):
            t = 0.02 * torch.randn(shape, generator=gen)
        else:
            t = torch.randn(shape, generator=gen) / shape[-1] ** 0.5
        tensors[name] = t
    return save_drafter(out, config, tensors)


def save_drafter(out: Path, config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> Path:
    """A drafter directory in the published layout: ``config.json`` and ``model.safetensors`` (the tensors by
    name, cast to the config's ``dtype``). The tiny generator and the presets' trained drafters write this way."""
    from safetensors.torch import save_file

    dtype = _DTYPES[str(config.get("dtype", "float32"))]
    weights = {name: tensors[name].detach().to("cpu", dtype).contiguous() for name in sorted(tensors)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(dict(config), indent=2) + "\n")
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def tiny_drafter_for(target: Mapping[str, Any], cache_root: Path, *, seed: int = 0) -> Path:
    """The ``draft: tiny-real-dflash`` drafter of a target, generated once into the engine cache."""
    from pd_dflash.engine.reference.artifacts import build_once

    config = tiny_drafter_config(target)
    key = json.dumps({"config": config, "seed": seed, "generator": GENERATOR_VERSION}, sort_keys=True)
    path = cache_root / "drafters" / f"{TINY_DRAFTER}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"

    def build(tmp: Path) -> dict[str, Any]:
        write_tiny_drafter(tmp, config, seed=seed)
        return {"kind": TINY_DRAFTER, "seed": seed, "generator_version": GENERATOR_VERSION}

    build_once(path, build)
    return path


def _dtype_name(target: Mapping[str, Any]) -> str:
    name = str(target.get("dtype") or target.get("torch_dtype") or "float32")
    return name if name in _DTYPES else "float32"
