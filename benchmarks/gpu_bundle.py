"""The device bundle's cache half (``scripts/gpu_bundle.sh`` runs it here, where presets train in minutes).

A lent GPU box has no network and no copy of this machine's git-ignored cache, so without help the check would
train every preset and drafter on the box's CPU inside its 8-minute call. This writes, into ``--out`` (a
``PD_DFLASH_CACHE`` root), the presets and DFlash drafters the check uses and the tiny real-layout checkpoints,
already trained (they are trained here first, in the normal cache, if they are not yet).

A preset's cache key includes torch's version (``presets/training.py: code_version``): the same torch gives
the same weights. The box's torch is not this machine's (the image's 2.11 against 2.13 here), so each artifact
is written under the key the box computes (``--torch``, the box's torch version); its ``card.json`` is copied
unchanged and ``bundle.json`` records the torch that trained it. The weights are then the ones trained here:
identical code, another torch build — what the check needs (a trained model whose routing is not random), not a
bit-reproduction of a training run on the box.

    python benchmarks/gpu_bundle.py --out .cache/gpu-bundle/pd-dflash --torch 2.11.0
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

#: What the check loads: presets (with their DFlash drafters) and tiny real-layout checkpoints.
PRESETS = ("micro", "mini-gpt-oss")
TINY_CHECKPOINTS = ("tiny-real-qwen3-moe", "tiny-real-gpt-oss")
#: The block sizes of the check's speculative cells (``benchmarks/gpu_steps.py``): a preset's drafter is per B.
BLOCK_SIZES = (8,)


@contextmanager
def torch_version_as(version: str):
    """Compute cache keys as a box with torch ``version`` would (``code_version`` reads ``torch.__version__``)."""
    import torch

    saved = torch.__version__
    torch.__version__ = version
    try:
        yield
    finally:
        torch.__version__ = saved


def _copy(source: Path, target: Path) -> dict:
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("*.lock"))
    return {"from": source.name, "to": str(target.relative_to(target.parents[1])), "bytes": _bytes(target)}


def _bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def build(out: Path, box_torch: str) -> dict:
    """Train (if needed) and copy every artifact under the box's keys; returns the manifest."""
    import torch

    from pd_dflash.engine.reference.checkpoints.tiny import TINY_CODE_FILES, materialise
    from pd_dflash.engine.reference.presets.catalog import get_preset
    from pd_dflash.engine.reference.presets.drafters import (
        DEFAULT_DRAFTER_STEPS,
        DRAFTER_STEPS,
        drafter_dir,
        load_drafter,
    )
    from pd_dflash.engine.reference.presets.training import load_preset, preset_dir

    torch.set_num_threads(1)
    artifacts = []
    for name in PRESETS:
        preset = get_preset(name)
        steps = DRAFTER_STEPS.get(name, DEFAULT_DRAFTER_STEPS)
        target, _ = load_preset(preset)
        here, there = [preset_dir(preset, 0)], []
        for block in BLOCK_SIZES:
            load_drafter(preset, target, block_size=block)
            here.append(drafter_dir(preset, 0, steps, block))
        with torch_version_as(box_torch):
            there = [preset_dir(preset, 0, str(out))]
            there += [drafter_dir(preset, 0, steps, block, str(out)) for block in BLOCK_SIZES]
        artifacts += [_copy(a, b) for a, b in zip(here, there, strict=True)]
    for name in TINY_CHECKPOINTS:  # keyed on the tiny writers' code and torch's version like the presets
        source = materialise(name)
        with torch_version_as(box_torch):
            from pd_dflash.engine.reference.presets.training import code_version

            key = code_version(TINY_CODE_FILES)
        artifacts.append(_copy(source, out / "checkpoints" / f"{name}-s0-{key}"))
    manifest = {
        "trained_with_torch": torch.__version__,
        "keyed_for_torch": box_torch,
        "artifacts": artifacts,
        "bytes": _bytes(out),
    }
    (out / "bundle.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the bundle's PD_DFLASH_CACHE root")
    parser.add_argument("--torch", required=True, help="the box's torch version (the image's: 2.11.0)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    manifest = build(args.out, args.torch.split("+")[0])
    print(f"gpu_bundle: {len(manifest['artifacts'])} artifacts, {manifest['bytes']:,} B in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
