"""The DFlash drafters of a reference preset, one per block size: trained by distillation on the target's greedy
rollouts within a fixed budget, cached next to the preset in the layout z-lab publishes, loaded by the same
loader as a published drafter (``dflash/load.py``) and served by the same source (``dflash/source.py``).

Cache: ``<cache root>/drafters/<preset>-s<seed>-<target code version>-<drafter code version>-n<steps>-b<B>``
holding ``config.json`` + ``model.safetensors`` (exactly what ``dflash/tiny.py`` and z-lab write; the embedding
and lm_head are the target's) and ``card.json`` (τ at its block size, greedy and T = 1; training facts). The
drafter code version hashes the DFlash modules, ``presets/drafter_training.py`` and this module (and the torch
version), so a code change retrains and a rerun reuses. Training runs under an exclusive ``fcntl`` lock (two
runners loading the same drafter: one trains, the other waits and reuses), single-threaded (bit-identical
weights whatever the runner's threads), and is published by an atomic rename — the preset cache's rules.

``python -m pd_dflash.engine.reference.presets.drafters --preset NAME`` trains (or reuses) a preset's drafters and
prints their τ (docs/reference-engine.md, "The block drafter").
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from pd_dflash.engine.reference.dflash.load import load_dflash_drafter
from pd_dflash.engine.reference.dflash.model import DFlashDrafter
from pd_dflash.engine.reference.dflash.tiny import save_drafter
from pd_dflash.engine.reference.presets.catalog import Preset
from pd_dflash.engine.reference.presets.drafter_training import (
    measure_block_tau,
    pool_sampler,
    preset_drafter_config,
    target_rollouts,
    train_drafter,
)
from pd_dflash.engine.reference.presets.training import build_once, cache_root, code_version, load_preset

_CODE_FILES = (
    "dflash/config.py",
    "dflash/load.py",
    "dflash/model.py",
    "dflash/tiny.py",
    "presets/drafter_training.py",
    "presets/drafters.py",
)
#: Distillation steps per preset and block size (the bounded training budget; ~0.05-0.1 s per step on one core).
DRAFTER_STEPS = {"micro": 200}
DEFAULT_DRAFTER_STEPS = 400
#: The recipe (docs/reference-engine.md, "The block drafter"): rollouts of 8-token language prompts continued by 40
#: target tokens, batches of 16 × 48 tokens, 8 anchors per sequence from the first generated token on; τ measured
#: over 128 held-out 40-token prompts.
POOL_PROMPTS, POOL_PROMPT_TOKENS, POOL_NEW_TOKENS, BATCH = 2048, 8, 40, 16
TAU_PROMPTS, TAU_PROMPT_TOKENS = 128, 40


def drafter_code_version() -> str:
    return code_version(_CODE_FILES)


def drafter_dir(preset: Preset, seed: int, steps: int, block_size: int, cache_dir: str | None = None) -> Path:
    name = f"{preset.name}-s{seed}-{code_version()}-{drafter_code_version()}-n{steps}-b{block_size}"
    return cache_root(cache_dir) / "drafters" / name


def load_drafter(
    preset: Preset,
    target: torch.nn.Module,
    *,
    block_size: int,
    seed: int = 0,
    steps: int | None = None,
    cache_dir: str | None = None,
) -> tuple[DFlashDrafter, dict[str, Any]]:
    """The preset's drafter for ``block_size`` on ``target`` (trained and cached on first use), and its facts:
    the loader's, with the card's τ, training facts and cache hit under ``card``. ``target`` is the engine's
    model: same weights as the cached preset."""
    steps = steps or DRAFTER_STEPS.get(preset.name, DEFAULT_DRAFTER_STEPS)
    path = drafter_dir(preset, seed, steps, block_size, cache_dir)
    trained = build_once(path, lambda tmp: _train_into(preset, seed, steps, block_size, tmp, cache_dir))
    card = json.loads((path / "card.json").read_text())
    drafter, facts = load_dflash_drafter(path, target, target_where=f"preset {preset.name}")
    card["cache_path"], card["cache_hit"] = str(path), not trained
    facts["card"] = {k: card.get(k) for k in ("tau", "train", "params", "cache_hit")}
    return drafter, facts


def _train_into(
    preset: Preset, seed: int, steps: int, block_size: int, tmp: Path, cache_dir: str | None
) -> dict[str, Any]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        config, drafter, card = train(preset, seed, steps, block_size, cache_dir)
        save_drafter(tmp, config, drafter.state_dict())
        return card
    finally:
        torch.set_num_threads(threads)


#: Rollout pools by preset target (cache path, seed): (pool, seconds it took), computed once per process.
_POOLS: dict[tuple[str, int], tuple[torch.Tensor, float]] = {}


def _rollout_pool(
    preset: Preset, seed: int, target_path: str, target: torch.nn.Module
) -> tuple[torch.Tensor, float]:
    """The distillation data and the seconds it took: the target's greedy rollouts, computed once per process and
    preset target (the drafters of every block size learn from the same pool)."""
    key = (target_path, seed)
    if key not in _POOLS:
        start = time.perf_counter()
        prompts = torch.from_numpy(preset.language.sample(POOL_PROMPTS, POOL_PROMPT_TOKENS, seed=[seed, 98]))
        _POOLS[key] = (target_rollouts(target, prompts, POOL_NEW_TOKENS), time.perf_counter() - start)
    return _POOLS[key]


def train(
    preset: Preset, seed: int, steps: int, block_size: int, cache_dir: str | None = None
) -> tuple[dict[str, Any], DFlashDrafter, dict[str, Any]]:
    """(config.json, drafter, card): a drafter distilled against the cached (un-offloaded) preset on its own
    greedy rollouts, and its τ."""
    target, target_card = load_preset(preset, seed=seed, cache_dir=cache_dir)
    lang = preset.language
    pool, rollout_seconds = _rollout_pool(preset, seed, target_card["cache_path"], target)
    config = preset_drafter_config(target.config, block_size)
    drafter, report = train_drafter(
        target,
        pool_sampler(pool, BATCH),
        steps=steps,
        seed=seed,
        config=config,
        min_anchor=POOL_PROMPT_TOKENS,
    )
    start = time.perf_counter()
    held_out = torch.from_numpy(lang.sample(TAU_PROMPTS, TAU_PROMPT_TOKENS, seed=[seed, 99]))
    tau = {}
    for temperature, name in ((0.0, "greedy"), (1.0, "t1")):
        gen = torch.Generator().manual_seed(seed + 6)
        tau[name] = float(measure_block_tau(target, drafter, held_out, temperature, gen).float().mean())
    card = {
        "kind": "dflash",
        "preset": preset.name,
        "seed": seed,
        "block_size": block_size,
        "target_code_version": target_card.get("code_version"),
        "drafter_code_version": drafter_code_version(),
        "params": sum(p.numel() for p in drafter.parameters()),
        "train": {
            "data": f"{POOL_PROMPTS} greedy target rollouts ({POOL_PROMPT_TOKENS}-token prompts + "
            f"{POOL_NEW_TOKENS} tokens), batches of {BATCH}",
            "steps": report.steps,
            "seconds": report.seconds,
            "rollout_seconds": rollout_seconds,
            "threads": 1,
            "first_loss": report.losses[0],
            "final_loss": sum(report.losses[-10:]) / len(report.losses[-10:]),
        },
        # τ: committed tokens per draft/verify round, bonus included, one round after each held-out prompt.
        "tau": tau,
        "tau_prompts": TAU_PROMPTS,
        "tau_seconds": time.perf_counter() - start,
    }
    return config, drafter, card


def main(argv: list[str] | None = None) -> None:
    """Train (or reuse from the cache) a preset's drafters and print their τ (greedy and T = 1) per block size."""
    import argparse

    from pd_dflash.engine.reference.presets.catalog import get_preset

    ap = argparse.ArgumentParser(
        prog="python -m pd_dflash.engine.reference.presets.drafters", description=main.__doc__
    )
    ap.add_argument("--preset", default="micro")
    ap.add_argument("--block-sizes", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # deterministic and fast on shared cores, like preset training
    preset = get_preset(args.preset)
    target, _ = load_preset(preset, seed=args.seed)
    for block in args.block_sizes:
        _, facts = load_drafter(preset, target, block_size=block, seed=args.seed)
        card, train_facts = facts["card"], facts["card"]["train"]
        print(
            f"{preset.name} B={block}: tau greedy {card['tau']['greedy']:.2f}, T=1 {card['tau']['t1']:.2f}; "
            f"{train_facts['steps']} steps {train_facts['seconds']:.1f} s (+ rollouts "
            f"{train_facts['rollout_seconds']:.1f} s), loss {train_facts['first_loss']:.3f} -> "
            f"{train_facts['final_loss']:.3f}; cache {'hit' if card['cache_hit'] else 'trained'}"
        )


if __name__ == "__main__":
    main()
