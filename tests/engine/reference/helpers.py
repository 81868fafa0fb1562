"""Builders shared by the reference-engine tests (fixtures live in conftest.py; docs/testing.md lists both):
tiny random-weight models of each MoE family, specs and engines over the trained ``micro`` preset, hand-built
expert stores, a hand-moved clock, an offloaded target with its runtime, and the GPU tests' figure recorder."""

from __future__ import annotations

import copy

import torch

from pd_dflash.engine.interface import EngineContext
from pd_dflash.engine.reference.decoding.loop import run_requests
from pd_dflash.engine.reference.decoding.target import AutoregressiveDecoding, Request, TargetModel
from pd_dflash.engine.reference.families import family_of
from pd_dflash.engine.reference.offload.cache import ExpertCache
from pd_dflash.engine.reference.offload.link import HostLink
from pd_dflash.engine.reference.offload.prefetch import ActivationAwarePrefetcher
from pd_dflash.engine.reference.offload.runtime import OffloadRuntime, install_offload
from pd_dflash.engine.reference.offload.store import HostExpertStore
from pd_dflash.engine.registry import engine_class
from pd_dflash.spec import parse_spec

CPU = torch.device("cpu")


# -- models ----------------------------------------------------------------------------------------------------
def tiny_model(family: str, seed: int = 0, **overrides):
    """A random-weight model of ``family`` (fp32, eval), small enough to build in milliseconds."""
    from transformers import (
        GptOssConfig,
        GptOssForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    common = dict(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    common.update(overrides)
    torch.manual_seed(seed)
    if family == "qwen3_moe":
        model = Qwen3MoeForCausalLM(
            Qwen3MoeConfig(**common, num_experts=8, moe_intermediate_size=16, intermediate_size=64)
        )
    elif family == "gpt_oss":
        model = GptOssForCausalLM(
            GptOssConfig(
                **common,
                num_local_experts=8,
                intermediate_size=16,
                sliding_window=8,  # shorter than the sequences: the sliding masks really matter
                rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
            )
        )
    elif family == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(**common, num_local_experts=8, intermediate_size=16))
    else:
        raise ValueError(family)
    return model.eval()


def eager_copy(model):
    """A copy running transformers' own per-expert loop: the reference the grouped and offloaded paths match."""
    ref = copy.deepcopy(model)
    ref.set_experts_implementation("eager")
    return ref


# -- specs and engines over the micro preset -------------------------------------------------------------------
WORKLOAD = {"requests": 4, "warmup_rounds": 1, "max_new_tokens": 12, "prompt_tokens": 12, "seed": 7}


def make_spec(baselines=("B0", "B3"), concurrency=(1, 4), memory=None, options=None, model=None, **extra):
    """A one-block-size CPU sweep over ``micro`` (or ``model``) with a short seeded workload; ``extra`` adds spec
    sections."""
    return parse_spec(
        {
            "name": "engine-test",
            "engine": "reference",
            "models": [model or {"id": "micro", "preset": "micro", "engine_options": options or {}}],
            "baselines": list(baselines),
            "block_sizes": [8],
            "concurrency": list(concurrency),
            "repeats": 1,
            "workload": WORKLOAD,
            "memory": {"expert_cache_fraction": 0.25} if memory is None else memory,
            "hardware": {"device": "cpu", "cpus_per_runner": 1},
            **extra,
        }
    )


def make_engine(spec):
    """The spec's engine for its first model on the CPU, as a runner builds it."""
    ctx = EngineContext.for_model(spec, device="cpu")
    return engine_class(spec.engine)(ctx)


# -- hand-built experts and a hand-moved clock -----------------------------------------------------------------
def store(storage="fp32", layers=2, experts=4, bias=False):
    """A host store of seeded experts of two matrices (6x3, 3x5) and an optional bias: sizes checkable by hand."""
    torch.manual_seed(0)
    tensors = {}
    for layer in range(layers):
        parts = [torch.randn(experts, 6, 3), torch.randn(experts, 3, 5)]
        if bias:
            parts.append(torch.randn(experts, 6))
        tensors[layer] = parts
    return HostExpertStore(tensors, storage=storage)


class SimClock:
    """A host clock the test moves by hand; ``sleep`` advances it (the link sleeps while compute waits)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


# -- an offloaded target, its runtime, and greedy generation through the step loop -----------------------------
def offloaded(model, storage="fp32"):
    """(target, host store) of a copy of ``model`` whose experts moved to the host store."""
    model = copy.deepcopy(model)
    family = family_of(model.config)
    store = install_offload(model, family, storage, pin=False)
    return TargetModel(model, family, CPU), store


def offloaded_runtime(model, fraction=0.5):
    """(target, runtime) of a copy of ``model``: ``fraction`` of its expert bytes cached (the default eviction)
    behind a plain host copy, no prefetcher."""
    target, store = offloaded(model)
    cache = ExpertCache(store, int(fraction * store.total_bytes), CPU, torch.float32, link=HostLink(None))
    rt = OffloadRuntime(store, cache, None)
    rt.attach(target.model)
    return target, rt


def runtime(target, store, *, fraction=None, policy="lru", gbps=None):
    """The offload runtime attached to ``target``: every expert cached (``fraction`` None), or a cache of that
    fraction of the expert bytes behind a link of ``gbps`` with an issuing prefetcher."""
    if fraction is None:
        cache = ExpertCache(store, store.total_bytes, CPU, torch.float32)
    else:
        link = HostLink(gbps)
        cache = ExpertCache(
            store, int(fraction * store.total_bytes), CPU, torch.float32, policy=policy, link=link
        )
    k = target.model.config.num_experts_per_tok
    prefetcher = ActivationAwarePrefetcher(store.layer_ids, store.num_experts, k, issue=fraction is not None)
    rt = OffloadRuntime(store, cache, prefetcher)
    rt.attach(target.model)
    return rt


def generate(target, rt, prompts, max_new, concurrency=1):
    """(outputs, rounds) of greedy AR through the step loop, the cache's transfers drained."""
    requests = [Request(i, p, max_new) for i, p in enumerate(prompts)]
    rounds = run_requests(
        target, requests, concurrency=concurrency, decoding=AutoregressiveDecoding(), hooks=rt
    )
    rt.cache.drain()
    return [r.output for r in requests], rounds


def prompts_for(vocab, n=3, length=12, seed=0):
    """``n`` seeded random prompts of lengths ``length``, ``length`` + 1, ...: requests of unequal length."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length + i,), generator=g).tolist() for i in range(n)]


# -- GPU figures -----------------------------------------------------------------------------------------------
def record_figure(test: str, **values) -> None:
    """Append a GPU test's measured figures to ``$PD_DFLASH_GPU_FIGURES`` (JSON lines) when it is set: the GPU
    check puts them in its summary, so a run records what it measured, not only pass/fail."""
    import json
    import os

    path = os.environ.get("PD_DFLASH_GPU_FIGURES")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"test": test, **values}, default=str) + "\n")


CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def make_tokenizer(path, vocab_size=64, *, chat_template=None):
    """A word-level tokenizer (``w0`` .. ``w{V-2}`` and ``[UNK]``), saved beside a checkpoint."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(vocab_size - 1)}
    vocab["[UNK]"] = vocab_size - 1
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    if chat_template:
        fast.chat_template = chat_template
    fast.save_pretrained(str(path))
    return fast


def hf_model(directory, dtype=None):
    """transformers' own load of the checkpoint (MXFP4 dequantised by transformers, on CPU)."""
    from transformers import AutoConfig, AutoModelForCausalLM, Mxfp4Config

    config = AutoConfig.from_pretrained(directory, local_files_only=True)
    kwargs = {"quantization_config": Mxfp4Config(dequantize=True)} if config.model_type == "gpt_oss" else {}
    if dtype is not None:
        kwargs["dtype"] = dtype
    return AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, **kwargs).eval()
