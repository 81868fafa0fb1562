"""Tiny random checkpoints in the two real layouts, with character-level tokenizers and chat templates.

- ``tiny-real-qwen3-moe``: a ``Qwen3MoeForCausalLM`` saved by transformers' ``save_pretrained`` in bf16 (the
  hub layout ``mlp.experts.{e}.{gate,up,down}_proj.weight``), sharded with an index like the real one.
- ``tiny-real-gpt-oss``: a ``GptOssForCausalLM`` as OpenAI publishes it: MXFP4 experts
  (``*_blocks`` uint8 ``[E, R, G, 16]``, ``*_scales`` uint8 ``[E, R, G]``, bf16 biases), everything else bf16,
  ``quantization_config: {quant_method: mxfp4, modules_to_not_convert: [...]}``, the published rope (yarn).

Neither declares an end-of-sequence id (the tokenizers still name their end token): a random model's greedy
continuation of the chat template's last tokens is the same for every prompt and may well be that token, which
would end every request after its prefill — nothing left to verify. Requests run to ``max_new_tokens``.

Deterministic in the seed. The engine generates them into its cache on first use (``materialise``) and then
loads them through the same path as any real checkpoint; ``python -m
pd_dflash.engine.reference.checkpoints.tiny OUT_DIR`` writes them anywhere.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from pd_dflash.engine.reference.checkpoints.resolve import TINY_REAL

VOCAB = 128
#: Characters the tokenizers know (one token each), after the special tokens.
_CHARS = [chr(c) for c in range(32, 127)] + ["\n", "\t"]
_QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_HARMONY_SPECIALS = ["<|endoftext|>", "<|start|>", "<|message|>", "<|end|>", "<|return|>", "<|channel|>"]
QWEN_TEMPLATE = (
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)
HARMONY_TEMPLATE = (
    "{%- for message in messages %}<|start|>{{ message.role }}<|message|>{{ message.content }}<|end|>"
    "{%- endfor %}{%- if add_generation_prompt %}<|start|>assistant{%- endif %}"
)
#: As in openai/gpt-oss-20b's config.json.
GPT_OSS_QUANTIZATION = {
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
    "quant_method": "mxfp4",
}
_COMMON = dict(
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


def write_tiny_qwen3_moe(
    path: Path, seed: int = 0, *, max_shard_size: str = "200KB", **overrides: Any
) -> dict[str, Any]:
    """``overrides`` replace config fields, e.g. a real routing geometry (``num_hidden_layers``,
    ``num_experts``, ``num_experts_per_tok``: ``benchmarks/engine_overhead.py``)."""
    from transformers import GenerationConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    ids = write_tokenizer(path, _QWEN_SPECIALS, QWEN_TEMPLATE, eos="<|im_end|>")
    fields = dict(
        _COMMON,
        num_experts=8,
        moe_intermediate_size=32,
        intermediate_size=128,
        norm_topk_prob=True,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0},
        pad_token_id=ids["<|endoftext|>"],
    )
    config = Qwen3MoeConfig(**{**fields, **overrides})
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config).to(torch.bfloat16)
    model.generation_config = GenerationConfig(pad_token_id=ids["<|endoftext|>"])
    model.save_pretrained(str(path), max_shard_size=max_shard_size)  # sharded + index, like the hub
    return {"layout": "qwen3-moe hub layout, bf16", "seed": seed}


def write_tiny_gpt_oss(path: Path, seed: int = 0, **overrides: Any) -> dict[str, Any]:
    """Random non-expert weights from the model class (bf16); random MXFP4 codes and scales for the experts.
    ``overrides`` replace config fields (layers alternate sliding and full attention, as published)."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig, GptOssConfig, GptOssForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    ids = write_tokenizer(path, _HARMONY_SPECIALS, HARMONY_TEMPLATE, eos="<|return|>")
    layers = int(overrides.get("num_hidden_layers", _COMMON["num_hidden_layers"]))
    alternating = [("sliding_attention", "full_attention")[i % 2] for i in range(layers)]
    fields = dict(
        _COMMON,
        num_local_experts=8,
        intermediate_size=64,
        sliding_window=8,
        layer_types=alternating,
        max_position_embeddings=131072,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "original_max_position_embeddings": 4096,
            "truncate": False,
        },
        pad_token_id=ids["<|endoftext|>"],
    )
    config = GptOssConfig(**{**fields, **overrides})
    torch.manual_seed(seed)
    model = GptOssForCausalLM(config).to(torch.bfloat16)
    gen = torch.Generator().manual_seed(seed + 1)
    state = {}
    for name, tensor in model.state_dict().items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            state.update(_random_mxfp4(name, tensor.shape, gen))
        else:
            state[name] = tensor.contiguous()
    config_dict = config.to_dict()
    config_dict.update(
        architectures=["GptOssForCausalLM"], quantization_config=GPT_OSS_QUANTIZATION, dtype="bfloat16"
    )
    (path / "config.json").write_text(json.dumps(config_dict, indent=2, sort_keys=True) + "\n")
    GenerationConfig(pad_token_id=ids["<|endoftext|>"]).save_pretrained(str(path))
    _save_sharded(state, path, save_file)
    return {"layout": "gpt-oss as published: MXFP4 experts, bf16 rest", "seed": seed}


def _random_mxfp4(name: str, dense_shape: torch.Size, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Blocks and scales for an ``[E, in, out]`` dense expert tensor: stored ``[E, out, in/32, 16]`` + scales
    ``[E, out, in/32]`` (the published orientation), scales around 2^-6 so activations stay O(1)."""
    experts, fan_in, fan_out = dense_shape
    groups = fan_in // 32
    blocks = torch.randint(0, 256, (experts, fan_out, groups, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(119, 124, (experts, fan_out, groups), generator=gen, dtype=torch.uint8)
    return {f"{name}_blocks": blocks, f"{name}_scales": scales}


def _save_sharded(state: dict[str, torch.Tensor], path: Path, save_file) -> None:
    """Two shards (layer 0 + embeddings, the rest) and the index, as a multi-file hub checkpoint has."""
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


WRITERS = {"tiny-real-qwen3-moe": write_tiny_qwen3_moe, "tiny-real-gpt-oss": write_tiny_gpt_oss}
assert tuple(WRITERS) == TINY_REAL


def materialise(name: str, cache_dir: str | None = None, seed: int = 0) -> Path:
    """The tiny checkpoint ``name`` in the engine cache, generated once (lock-protected, atomic publish)."""
    from pd_dflash.engine.reference.presets.training import build_once, cache_root, code_version

    version = code_version(("checkpoints/tiny.py",))
    target = cache_root(cache_dir) / "checkpoints" / f"{name}-s{seed}-{version}"
    build_once(target, lambda tmp: {"name": name, **WRITERS[name](tmp, seed)})
    return target


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Write the tiny real-layout checkpoints into OUT_DIR/<name>."
    )
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name, write in WRITERS.items():
        write(args.out_dir / name, args.seed)
        print(args.out_dir / name)


if __name__ == "__main__":
    main()
