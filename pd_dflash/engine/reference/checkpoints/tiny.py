"""Tiny random checkpoints in the real layouts, with character-level tokenizers and chat templates: one per
family that has one (``MoEFamily.tiny_name`` / ``write_tiny``, in ``families/<family>.py``):

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
pd_dflash.engine.reference.checkpoints.tiny OUT_DIR`` writes them anywhere. The files every one of them has
(tokenizer, shards) are ``tiny_files.py``'s.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pd_dflash.engine.reference.families import FAMILIES, FAMILY_FILES, MoEFamily

#: Each tiny checkpoint's family, by name (``resolve.TINY_REAL``: the names).
TINY: dict[str, MoEFamily] = {f.tiny_name: f for f in FAMILIES.values() if f.tiny_name}
#: The code that decides a tiny checkpoint's bytes (relative to ``engine/reference/``): its cache key.
TINY_CODE_FILES = ("checkpoints/tiny.py", "families/tiny_files.py", *FAMILY_FILES)


def materialise(name: str, cache_dir: str | None = None, seed: int = 0) -> Path:
    """The tiny checkpoint ``name`` in the engine cache, generated once (lock-protected, atomic publish)."""
    from pd_dflash.engine.reference.artifacts import build_once, cache_root, code_version

    version = code_version(TINY_CODE_FILES)
    target = cache_root(cache_dir) / "checkpoints" / f"{name}-s{seed}-{version}"
    build_once(target, lambda tmp: {"name": name, **TINY[name].write_tiny(tmp, seed)})
    return target


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Write the tiny real-layout checkpoints into OUT_DIR/<name>."
    )
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name, family in TINY.items():
        family.write_tiny(args.out_dir / name, args.seed)
        print(args.out_dir / name)


if __name__ == "__main__":
    main()
