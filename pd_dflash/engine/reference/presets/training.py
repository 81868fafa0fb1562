"""Train a preset deterministically on its synthetic language, cache it on disk, and write its model card.

The cache key is preset + seed + a hash of the code that defines the weights (this module, the preset table
and the language), so a code change retrains and a rerun reuses. Two runner processes may load the same preset
at once: training happens under an ``fcntl`` lock and the result is published with an atomic rename.
Training always uses ONE thread: the weights are then bit-identical whatever the runner's thread count.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pd_dflash.engine.reference import artifacts
from pd_dflash.engine.reference.artifacts import build_once, cache_root
from pd_dflash.engine.reference.families import FAMILY_FILES, family_of
from pd_dflash.engine.reference.presets.catalog import Preset, build_config, model_class

#: Paths relative to ``engine/reference/``.
_CODE_FILES = ("presets/training.py", "presets/catalog.py", "presets/language.py", *FAMILY_FILES)


def code_version(files: tuple[str, ...] = _CODE_FILES) -> str:
    """The presets' cache key part (``artifacts.code_version`` of their source files by default)."""
    return artifacts.code_version(files)


def preset_dir(preset: Preset, seed: int, cache_dir: str | None = None) -> Path:
    return cache_root(cache_dir) / "presets" / f"{preset.name}-s{seed}-{code_version()}"


def load_preset(preset: Preset, seed: int = 0, cache_dir: str | None = None) -> tuple[torch.nn.Module, dict]:
    """The trained model (fp32, eval mode, on CPU) and its model card; trains and caches it on first use."""
    target = preset_dir(preset, seed, cache_dir)

    def build(tmp: Path) -> dict[str, Any]:
        model, card = train(preset, seed)
        model.save_pretrained(str(tmp))
        return card

    trained = build_once(target, build)
    card = json.loads((target / "card.json").read_text())
    model = model_class(preset.family).from_pretrained(
        str(target), local_files_only=True, dtype=torch.float32
    )
    card["cache_path"] = str(target)
    card["cache_hit"] = not trained
    return model.eval(), card


def train(preset: Preset, seed: int = 0) -> tuple[torch.nn.Module, dict[str, Any]]:
    """Train for exactly ``preset.train_steps`` AdamW steps (warm-up + cosine), single-threaded, seeded."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train(preset, seed)
    finally:
        torch.set_num_threads(threads)


def _train(preset: Preset, seed: int) -> tuple[torch.nn.Module, dict[str, Any]]:
    lang = preset.language
    config = build_config(preset)
    config.output_router_logits = preset.router_aux_loss_coef > 0  # adds the load-balancing loss
    torch.manual_seed(seed)
    model = model_class(preset.family)(config)
    model.set_experts_implementation("grouped_mm")  # the fastest experts implementation for CPU training
    model.train()
    steps, batch = preset.train_steps, preset.batch
    data = torch.from_numpy(lang.sample(steps * batch, preset.seq_len, seed=[seed, 1]))
    start = time.perf_counter()

    def loss_at(step: int) -> torch.Tensor:
        x = data[step * batch : (step + 1) * batch]
        return model(input_ids=x, labels=x).loss

    losses = fit(
        list(model.parameters()), loss_at, steps=steps, lr=preset.lr, warmup_steps=preset.warmup_steps
    )
    seconds = time.perf_counter() - start
    model.config.output_router_logits = False
    model.eval()
    card = {
        "preset": preset.name,
        "family": preset.family,
        "mirrors": preset.mirrors,
        "seed": seed,
        "code_version": code_version(),
        "train": {
            "steps": steps,
            "batch": batch,
            "seq_len": preset.seq_len,
            "lr": preset.lr,
            "seconds": seconds,
            "threads": 1,
            "final_train_loss": float(np.mean(losses[-10:])),
            "torch": torch.__version__,
        },
        "language": lang.model_dump(),
        **evaluate(model, preset, seed),
    }
    return model, card


def lr_at(step: int, steps: int, lr: float, warmup_steps: int, floor: float = 0.0) -> float:
    """The presets' one learning-rate schedule: a linear warm-up over ``warmup_steps`` times a cosine from ``lr``
    at step 0 down to ``floor · lr`` at the end."""
    warm = min(1.0, (step + 1) / max(1, warmup_steps))
    return lr * (warm * (floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * step / steps))))


def fit(
    parameters: list[torch.nn.Parameter],
    loss_at: Callable[[int], torch.Tensor],
    *,
    steps: int,
    lr: float,
    warmup_steps: int,
    floor: float = 0.0,
) -> list[float]:
    """The presets' one training loop (targets here, drafters in ``drafter_training.py``): AdamW (β 0.9/0.95, no
    weight decay) at ``lr_at``'s rate, the gradient norm clipped to 1, ``loss_at(step)`` the step's loss (its
    data are the caller's). Deterministic given deterministic losses; returns the loss of every step."""
    opt = torch.optim.AdamW(parameters, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    losses = []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup_steps, floor)
        loss = loss_at(step)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@torch.no_grad()
def evaluate(model: torch.nn.Module, preset: Preset, seed: int = 0) -> dict[str, Any]:
    """Held-out loss against the uniform and entropy-floor references, sizes, and routing statistics."""
    lang = preset.language
    x = torch.from_numpy(lang.sample(64, preset.seq_len, seed=[seed, 2]))
    routed: dict[int, torch.Tensor] = {}
    family = family_of(model.config)
    hooks = []
    for i, layer in enumerate(model.model.layers):
        router = getattr(layer.mlp, family.router_attr)

        def hook(_mod, _inp, out, i=i):
            routed[i] = out[2].reshape(
                x.shape[0], x.shape[1], -1
            )  # router_indices; returning None is required

        hooks.append(router.register_forward_hook(hook))
    try:
        logits = model(input_ids=x).logits
    finally:
        for h in hooks:
            h.remove()
    ce = torch.nn.functional.cross_entropy(logits[:, 1:-1].reshape(-1, lang.vocab_size), x[:, 2:].reshape(-1))
    loss, floor, uniform = float(ce), lang.entropy_floor_nats(), lang.uniform_nats()
    experts = preset.experts
    expert_params = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    return {
        "loss": {
            "eval_nats": loss,
            "entropy_floor_nats": floor,
            "uniform_nats": uniform,
            "gap_to_floor_nats": loss - floor,
            "fraction_of_gap_closed": (uniform - loss) / (uniform - floor),
        },
        "sizes": {
            "params": sum(p.numel() for p in model.parameters()),
            "expert_params": expert_params,
            "experts_per_layer": experts,
            "top_k": preset.top_k,
            "layers": preset.layers,
            "fp32_bytes_per_expert": expert_params * 4 // (experts * preset.layers),
        },
        "routing": routing_stats(routed, experts, preset.top_k),
    }


def routing_stats(routed: dict[int, torch.Tensor], experts: int, top_k: int) -> dict[str, Any]:
    """Skew and correlation of routing ([seqs, tokens, k] expert ids per layer).

    - usage_entropy_fraction: entropy of the expert-usage distribution over all tokens / log(E) (1 = uniform);
    - per_sequence_union_fraction: experts a sequence touches / E, against the fraction uniform routing of the
      same number of tokens would touch (correlation within a request);
    - reuse_next_token: P(an expert of token t is also an expert of token t+1), against k/E for independence.
    """
    ent, union, union_uniform, reuse = [], [], [], []
    for ids in routed.values():
        seqs, tokens, _ = ids.shape
        counts = torch.bincount(ids.reshape(-1), minlength=experts).double()
        p = counts / counts.sum()
        ent.append(float(-(p[p > 0] * p[p > 0].log()).sum() / math.log(experts)))
        onehot = torch.zeros(seqs, tokens, experts, dtype=torch.bool)
        onehot.scatter_(2, ids, True)
        union.append(float(onehot.any(dim=1).double().mean()))
        union_uniform.append(1 - (1 - top_k / experts) ** tokens)
        shared = (onehot[:, 1:] & onehot[:, :-1]).sum(dim=2).double()
        reuse.append(float(shared.mean() / top_k))
    return {
        "usage_entropy_fraction": float(np.mean(ent)),
        "per_sequence_union_fraction": float(np.mean(union)),
        "per_sequence_union_fraction_if_uniform": float(np.mean(union_uniform)),
        "reuse_next_token": float(np.mean(reuse)),
        "reuse_next_token_if_independent": top_k / experts,
    }
