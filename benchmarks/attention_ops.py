"""Ops dispatched per generated token by the reference engine's target forward at c = 1, 4, 16: batched attention
(one attention call per layer over every in-flight request, ``decoding/kv_arena.py``) makes them FALL with c.

Tiny math (hidden 64) at a real target's routing geometry (default Qwen3-Coder-30B-A3B's: 48 layers × 128
experts, top-8; random weights), 16 requests, a 32-token prompt and 16 new tokens each, greedy AR through the
step loop (``decoding/loop.run_requests``), prefills included. The model's own experts run as transformers'
``grouped_mm`` (a constant number of ops per MoE layer), so the figure isolates what the engine adds around
them: attention, KV cache, ids/positions/masks and the LM head. Ops are counted with a
``torch.utils._python_dispatch.TorchDispatchMode`` (every ``__torch_dispatch__`` call); the table prints ops per
generated token per c and the ratio to c = 1.

    .venv/bin/python benchmarks/attention_ops.py
    .venv/bin/python benchmarks/attention_ops.py --family gpt_oss --layers 24 --experts 32 --top-k 4

Run it against another checkout's ``pd_dflash`` (e.g. the code before the arena) with ``--code DIR``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--family", choices=("qwen3_moe", "gpt_oss", "mixtral"), default="qwen3_moe")
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument(
        "--code", type=Path, default=Path(__file__).resolve().parents[1], help="checkout to import"
    )
    args = p.parse_args()
    sys.path.insert(0, str(args.code))
    import torch

    torch.set_num_threads(1)
    model = build(args)
    print(
        f"{args.family}: {args.layers} layers x {args.experts} experts, top-{args.top_k}, hidden 64; code {args.code}"
    )
    print("| c | ops per generated token | ratio to c = 1 | ms per generated token |")
    print("|---|---|---|---|")
    base = None
    for c in args.concurrency:
        ops, seconds, tokens = serve(model, args, c)
        base = base or ops / tokens
        print(f"| {c} | {ops / tokens:,.0f} | {ops / tokens / base:.2f} | {1e3 * seconds / tokens:.1f} |")


def build(args):
    import torch
    from transformers import (
        GptOssConfig,
        GptOssForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    common = dict(
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts_per_tok=args.top_k,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    if args.family == "qwen3_moe":
        cfg = Qwen3MoeConfig(
            **common, num_experts=args.experts, moe_intermediate_size=32, intermediate_size=64
        )
        model = Qwen3MoeForCausalLM(cfg)
    elif args.family == "gpt_oss":
        cfg = GptOssConfig(**common, num_local_experts=args.experts, intermediate_size=32, sliding_window=16)
        model = GptOssForCausalLM(cfg)
    else:
        model = MixtralForCausalLM(
            MixtralConfig(**common, num_local_experts=args.experts, intermediate_size=32)
        )
    model.set_experts_implementation("grouped_mm")
    return model.eval()


def serve(model, args, concurrency: int) -> tuple[int, float, int]:
    """(ops dispatched, seconds, generated tokens) of serving every request at ``concurrency``."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from pd_dflash.engine.reference.decoding.loop import RoundHooks, run_requests
    from pd_dflash.engine.reference.decoding.target import AutoregressiveDecoding, Request, TargetModel
    from pd_dflash.engine.reference.families import family_of

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    target = TargetModel(model, family_of(model.config), torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    prompts = [torch.randint(0, vocab, (args.prompt,), generator=g).tolist() for _ in range(args.requests)]
    requests = [Request(i, p, args.new_tokens) for i, p in enumerate(prompts)]
    start = time.perf_counter()
    with Count():
        run_requests(
            target, requests, concurrency=concurrency, decoding=AutoregressiveDecoding(), hooks=RoundHooks()
        )
    seconds = time.perf_counter() - start
    return Count.ops, seconds, sum(len(r.output) for r in requests)


if __name__ == "__main__":
    main()
