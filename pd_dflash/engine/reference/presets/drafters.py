"""The DFlash drafter of a reference preset: trained by distillation on the target's greedy rollouts within a
fixed budget, cached next to the preset, with a drafter card (τ at B = 8 and 16, greedy and T = 1).

Cache: ``<cache root>/drafters/<preset>-s<seed>-<target code version>-<drafter code version>-n<steps>`` holding
``drafter.pt`` (config + the drafter's own weights; the embedding, final norm and LM head are the target's) and
``card.json``. The drafter code version hashes ``block_drafter.py``, ``presets/drafter_training.py`` and this
module (and the torch version), so a code change retrains and a rerun reuses. Training runs under an exclusive
``fcntl`` lock (two runners loading the same preset: one trains, the other waits and reuses), single-threaded
(bit-identical weights whatever the runner's threads), and is published by an atomic rename — the preset
cache's rules.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from pd_dflash.engine.reference.block_drafter import BlockDrafter, DrafterConfig, SharedTargetParts
from pd_dflash.engine.reference.presets.catalog import Preset
from pd_dflash.engine.reference.presets.drafter_training import (
    measure_block_tau,
    pool_sampler,
    target_rollouts,
    train_drafter,
)
from pd_dflash.engine.reference.presets.training import build_once, cache_root, code_version, load_preset

_CODE_FILES = ("block_drafter.py", "presets/drafter_training.py", "presets/drafters.py")
#: Distillation steps per preset (the bounded training budget; ~0.1-0.25 s per step on one shared core).
DRAFTER_STEPS = {"micro": 200}
DEFAULT_DRAFTER_STEPS = 300
#: The recipe (docs/reference-engine.md, "The block drafter"): rollouts of 8-token language prompts continued by 40
#: target tokens, batches of 16 × 48 tokens, 8 anchors per sequence; τ measured over 128 held-out 40-token prompts.
POOL_PROMPTS, POOL_PROMPT_TOKENS, POOL_NEW_TOKENS, BATCH = 2048, 8, 40, 16
TAU_PROMPTS, TAU_PROMPT_TOKENS = 128, 40


def drafter_code_version() -> str:
    return code_version(_CODE_FILES)


def drafter_dir(preset: Preset, seed: int, steps: int, cache_dir: str | None = None) -> Path:
    name = f"{preset.name}-s{seed}-{code_version()}-{drafter_code_version()}-n{steps}"
    return cache_root(cache_dir) / "drafters" / name


def load_drafter(
    preset: Preset,
    target: torch.nn.Module,
    *,
    seed: int = 0,
    steps: int | None = None,
    cache_dir: str | None = None,
) -> tuple[BlockDrafter, dict[str, Any]]:
    """The preset's trained DFlash drafter sharing ``target``'s embedding, norm and head (trained and cached on
    first use), and its card. ``target`` is the engine's model: same weights as the cached preset."""
    steps = steps or DRAFTER_STEPS.get(preset.name, DEFAULT_DRAFTER_STEPS)
    path = drafter_dir(preset, seed, steps, cache_dir)
    trained = build_once(path, lambda tmp: _train_into(preset, seed, steps, tmp, cache_dir))
    card = json.loads((path / "card.json").read_text())
    checkpoint = torch.load(path / "drafter.pt", map_location="cpu", weights_only=True)
    drafter = BlockDrafter.from_checkpoint(checkpoint, SharedTargetParts.from_causal_lm(target))
    param = next(target.parameters())
    card["cache_path"], card["cache_hit"] = str(path), not trained
    return drafter.to(device=param.device, dtype=param.dtype).eval(), card


def _train_into(preset: Preset, seed: int, steps: int, tmp: Path, cache_dir: str | None) -> dict[str, Any]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        drafter, card = train(preset, seed, steps, cache_dir)
        torch.save(drafter.to_checkpoint(), tmp / "drafter.pt")
        return card
    finally:
        torch.set_num_threads(threads)


def train(preset: Preset, seed: int, steps: int, cache_dir: str | None = None) -> tuple[BlockDrafter, dict]:
    """Distil a drafter against the cached (un-offloaded) preset on its own greedy rollouts; measure τ."""
    target, target_card = load_preset(preset, seed=seed, cache_dir=cache_dir)
    lang = preset.language
    start = time.perf_counter()
    prompts = torch.from_numpy(lang.sample(POOL_PROMPTS, POOL_PROMPT_TOKENS, seed=[seed, 98]))
    pool = target_rollouts(target, prompts, POOL_NEW_TOKENS)
    rollout_seconds = time.perf_counter() - start
    config = DrafterConfig.for_target(target.config, block_size=16)
    drafter, report = train_drafter(target, pool_sampler(pool, BATCH), steps=steps, seed=seed, config=config)
    start = time.perf_counter()
    held_out = torch.from_numpy(lang.sample(TAU_PROMPTS, TAU_PROMPT_TOKENS, seed=[seed, 99]))
    tau = {}
    for temperature, name in ((0.0, "greedy"), (1.0, "t1")):
        for block in (8, 16):
            gen = torch.Generator().manual_seed(seed + 6)
            got = measure_block_tau(target, drafter, held_out, block, temperature, gen).float().mean()
            tau[f"b{block}_{name}"] = float(got)
    card = {
        "kind": "dflash",
        "preset": preset.name,
        "seed": seed,
        "target_code_version": target_card.get("code_version"),
        "drafter_code_version": drafter_code_version(),
        "config": config.model_dump(mode="json"),
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
    return drafter, card
