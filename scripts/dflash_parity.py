#!/usr/bin/env python
"""Token-for-token parity of pd-dflash's DFlash drafter with the official ``dflash`` package (z-lab, MIT).

The official package cannot live in the project's environment (its base install pins ``tqdm==4.70.0`` and
``datasets==5.0.1``, which pulls ``huggingface_hub<2`` — pip would downgrade two installed packages; its
``[local]`` extra pins ``transformers==5.15.0``), so it runs in its own environment
(``scripts/dflash_official_env.sh``), on inputs this script writes from the project's:

    python scripts/dflash_parity.py inputs DIR              # project env: tiny targets, drafters, contexts
    python scripts/dflash_parity.py official DIR OUT.json   # official env: what DFlashDraftModel drafts on them
    python scripts/dflash_parity.py fixture --official-python PY   # both; rewrites the pinned fixture

Two scenarios per case (a tiny target + a tiny random drafter in the published layout):

- ``loop``: the official ``dflash_generate`` (greedy) on each prompt, recording every drafted block (its
  ``compute_logits`` is wrapped) and the output ids; pd-dflash's engine loop must draft the same blocks;
- ``module``: a fixed sequence of drafter calls with 1..B context rows each (as acceptance would give) on one
  drafter KV, cropped after each call — the drafted tokens and logits.

The ``official`` stage imports only torch, transformers, safetensors and dflash, so it runs in the official
environment unchanged. The pinned fixture (tests/engine/reference/fixtures/dflash_official.json) carries the
official outputs and a digest of the inputs; CI regenerates the inputs, checks the digest, and compares.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FIXTURE = REPO / "tests" / "engine" / "reference" / "fixtures" / "dflash_official.json"
#: Tiny drafters over tiny targets: non-causal with GQA (the published shape); sliding + causal layers with
#: scaled inputs/outputs and a softcap (every option of the official attention and logits paths).
CASES = [
    {"name": "qwen3_moe", "family": "qwen3_moe", "block_size": 8, "drafter": {"num_hidden_layers": 2}},
    {
        "name": "gpt_oss-sliding",
        "family": "gpt_oss",
        "block_size": 6,
        "drafter": {
            "num_hidden_layers": 2,
            "layer_types": ["sliding_attention", "full_attention"],
            "use_sliding_window": True,
            "sliding_window": 5,
            "max_window_layers": 0,
            "final_logit_softcapping": 3.0,
            "dflash_config_extra": {"input_embedding_scale": 1.5, "output_multiplier": 0.75},
        },
    },
]
PROMPTS = [[3, 17, 42, 5, 9, 11, 2], [60, 1, 33, 33, 8], [7, 7, 21, 50, 13, 4, 19, 44, 2, 6]]
MAX_NEW_TOKENS = 24
#: Context rows per drafter call in the module scenario (the first: a prompt; then 1..B accepted rows).
MODULE_STEPS = [7, 3, 1, 6, 2, 5, 1, 4]


# -- inputs (project environment) ----------------------------------------------------------------------------
def write_inputs(root: Path) -> None:
    import torch
    from safetensors.torch import save_file

    from pd_dflash.engine.reference.dflash.tiny import tiny_drafter_config, write_tiny_drafter
    from tests.engine.reference.helpers import tiny_model

    root.mkdir(parents=True, exist_ok=True)
    for family in sorted({c["family"] for c in CASES}):
        model = reseeded(tiny_model(family), seed=11)
        model.save_pretrained(str(root / "targets" / family))
    for i, case in enumerate(CASES):
        target = json.loads((root / "targets" / case["family"] / "config.json").read_text())
        overrides = dict(case["drafter"])
        extra = overrides.pop("dflash_config_extra", {})
        config = tiny_drafter_config(target, block_size=case["block_size"], **overrides)
        config["dflash_config"].update(extra)
        write_tiny_drafter(root / "drafters" / case["name"], config, seed=100 + i)
        width = len(config["dflash_config"]["target_layer_ids"]) * config["hidden_size"]
        gen = torch.Generator().manual_seed(200 + i)
        tensors = {f"step{j}": torch.randn(n, width, generator=gen) for j, n in enumerate(MODULE_STEPS)}
        tensors["anchors"] = torch.randint(0, config["vocab_size"] - 1, (len(MODULE_STEPS),), generator=gen)
        save_file(tensors, str(root / "drafters" / case["name"] / "module_inputs.safetensors"))


def reseeded(model, seed: int):
    """Overwrite every parameter from a seeded CPU generator, so the target does not depend on how a
    transformers version initialises it (norms ≈ 1, biases small, matrices ~ 1/sqrt(fan-in))."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "norm" in name:
                value = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
            elif p.dim() == 1:
                value = 0.1 * torch.randn(p.shape, generator=gen)
            else:
                value = torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5
            p.copy_(value)
    return model


def inputs_digest(root: Path) -> str:
    """sha256 of what the official stage reads: the scenario, the drafters' configs (canonical JSON) and every
    tensor (names, dtypes, bytes). A target's config.json is transformers' own dump of the tiny config (its
    tensors are hashed), left out so that a transformers upgrade adding a default key does not matter."""
    from safetensors import safe_open

    h = hashlib.sha256(json.dumps([CASES, PROMPTS, MAX_NEW_TOKENS, MODULE_STEPS]).encode())
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.name == "config.json" and rel.startswith("drafters/"):  # a target's is transformers' own dump
            config = json.loads(path.read_text())
            h.update(rel.encode() + json.dumps(config, sort_keys=True).encode())
        elif path.suffix == ".safetensors":
            with safe_open(str(path), "pt") as f:
                for key in sorted(f.keys()):
                    t = f.get_tensor(key).contiguous()
                    h.update(f"{rel}:{key}:{t.dtype}:{list(t.shape)}".encode())
                    h.update(t.view(-1).view(__import__("torch").uint8).numpy().tobytes())
    return h.hexdigest()


# -- the official implementation (official environment: torch, transformers, safetensors, dflash) ------------
def run_official(root: Path) -> dict:
    import dflash
    import torch
    import transformers
    from dflash import model as official
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    out = {
        "versions": {
            "dflash": _version("dflash"),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        }
    }
    del dflash
    for case in CASES:
        target = AutoModelForCausalLM.from_pretrained(
            root / "targets" / case["family"], dtype=torch.float32
        ).eval()
        path = root / "drafters" / case["name"]
        drafter = official.DFlashDraftModel.from_pretrained(path, dtype=torch.float32).eval()
        block = case["block_size"]
        drafted: list[list[int]] = []
        compute = drafter.compute_logits

        def recording(hidden, head, compute=compute, drafted=drafted):
            logits = compute(hidden, head)
            drafted.append(logits.argmax(-1)[0].tolist())
            return logits

        drafter.compute_logits = recording
        loop = []
        for prompt in PROMPTS:
            drafted.clear()
            ids = official.dflash_generate(
                drafter, target, torch.tensor([prompt]), MAX_NEW_TOKENS, None, 0.0, block_size=block
            )
            loop.append({"drafts": list(drafted), "output": ids[0, len(prompt) :].tolist()})
        drafter.compute_logits = compute
        inputs = load_file(str(path / "module_inputs.safetensors"))
        cache, start, module = official._make_cache(drafter.config), 0, []
        scale = float(official._draft_value(drafter.config, "input_embedding_scale", 1.0))
        with torch.inference_mode():
            for j, n in enumerate(MODULE_STEPS):
                anchor_pos = start + n
                ids = torch.tensor([[int(inputs["anchors"][j])] + [drafter.mask_token_id] * (block - 1)])
                hidden = drafter(
                    target_hidden=inputs[f"step{j}"][None],
                    noise_embedding=official._raw_input_embeddings(target, ids, scale),
                    position_ids=torch.arange(start, anchor_pos + block)[None],
                    past_key_values=cache,
                    use_cache=True,
                )[:, 1 - block :]
                official._crop_to(cache, anchor_pos)
                logits = drafter.compute_logits(hidden, official._output_head(target))[0]
                module.append({"tokens": logits.argmax(-1).tolist(), "logits": logits.tolist()})
                start = anchor_pos
        out[case["name"]] = {"loop": loop, "module": module}
    return out


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


# -- pd-dflash's implementation (project environment) ----------------------------------------------------------
def run_ours(root: Path, *, concurrency: int = 1) -> dict:
    """The same scenarios through pd-dflash: the engine's decode loop (``concurrency`` requests in flight,
    drafted together) and the drafter module on one KV."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from pd_dflash.engine.reference.decoding.loop import RoundHooks, run_requests
    from pd_dflash.engine.reference.decoding.speculative import SpeculativeDecoding
    from pd_dflash.engine.reference.decoding.target import Request, TargetModel
    from pd_dflash.engine.reference.dflash.load import load_dflash_drafter
    from pd_dflash.engine.reference.dflash.model import DraftKV, DraftRows
    from pd_dflash.engine.reference.dflash.source import DFlashSource
    from pd_dflash.engine.reference.families import family_of

    torch.set_num_threads(1)
    out = {}
    for case in CASES:
        model = AutoModelForCausalLM.from_pretrained(
            root / "targets" / case["family"], dtype=torch.float32
        ).eval()
        path = root / "drafters" / case["name"]
        drafter, facts = load_dflash_drafter(path, model)
        block = case["block_size"]
        source = DFlashSource(drafter, facts)
        drafted: dict[str, list[list[int]]] = {}
        draft = source.draft

        def recording(requests, b, t, draft=draft, drafted=drafted):
            blocks = draft(requests, b, t)
            for blk in blocks:
                drafted.setdefault(blk.request.rid, []).append(list(blk.drafts))
            return blocks

        source.draft = recording
        target = TargetModel(model, family_of(model.config), torch.device("cpu"))
        requests = [Request(f"p{i}", list(p), MAX_NEW_TOKENS) for i, p in enumerate(PROMPTS)]
        run_requests(
            target,
            requests,
            concurrency=concurrency,
            decoding=SpeculativeDecoding(source, block),
            hooks=RoundHooks(),
        )
        loop = [{"drafts": drafted[r.rid], "output": r.output} for r in requests]
        inputs = load_file(str(path / "module_inputs.safetensors"))
        kv, module = DraftKV(), []
        for j, _n in enumerate(MODULE_STEPS):
            rows = DraftRows(kv, inputs[f"step{j}"], int(inputs["anchors"][j]))
            logits = drafter.logits(drafter([rows], block)[:, 1:])[0]
            module.append({"tokens": logits.argmax(-1).tolist(), "logits": logits.tolist()})
        out[case["name"]] = {"loop": loop, "module": module}
    return out


def compare(official: dict, ours: dict, *, atol: float = 1e-4) -> list[str]:
    """Differences between the two implementations' outputs (empty: parity). A loop's drafted blocks are
    compared while the official loop drafts full blocks (near the end it shortens them; the engine does not)."""
    problems = []
    for case in CASES:
        name, block = case["name"], case["block_size"]
        for i, (theirs, mine) in enumerate(zip(official[name]["loop"], ours[name]["loop"], strict=True)):
            full = [d for d in theirs["drafts"] if len(d) == block - 1]
            if mine["drafts"][: len(full)] != full:
                problems.append(
                    f"{name} prompt {i}: drafted blocks differ: official {full}, ours {mine['drafts']}"
                )
            if mine["output"] != theirs["output"]:
                problems.append(f"{name} prompt {i}: outputs differ: {theirs['output']} vs {mine['output']}")
        for j, (theirs, mine) in enumerate(zip(official[name]["module"], ours[name]["module"], strict=True)):
            if theirs["tokens"] != mine["tokens"]:
                problems.append(f"{name} module step {j}: tokens {theirs['tokens']} vs {mine['tokens']}")
            worst = max(
                abs(a - b)
                for ra, rb in zip(theirs["logits"], mine["logits"], strict=True)
                for a, b in zip(ra, rb, strict=True)
            )
            if worst > atol:
                problems.append(f"{name} module step {j}: logits differ by {worst:.3g} (> {atol})")
    return problems


def make_fixture(official_python: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "inputs"
        write_inputs(root)
        result = Path(tmp) / "official.json"
        subprocess.run([official_python, __file__, "official", str(root), str(result)], check=True)
        official = json.loads(result.read_text())
        for name in (c["name"] for c in CASES):  # 6 decimals: far below the comparison's tolerance
            for step in official[name]["module"]:
                step["logits"] = [[round(x, 6) for x in row] for row in step["logits"]]
        fixture = {
            "generated_by": "python scripts/dflash_parity.py fixture --official-python <official env python>",
            "inputs_digest": inputs_digest(root),
            "official": official,
        }
        problems = compare(official, run_ours(root))
    FIXTURE.parent.mkdir(parents=True, exist_ok=True)
    FIXTURE.write_text(json.dumps(fixture) + "\n")
    return {"fixture": str(FIXTURE), "parity_problems": problems}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("inputs").add_argument("dir", type=Path)
    p = sub.add_parser("official")
    p.add_argument("dir", type=Path)
    p.add_argument("out", type=Path)
    sub.add_parser("fixture").add_argument("--official-python", required=True)
    args = parser.parse_args(argv)
    if args.cmd == "inputs":
        write_inputs(args.dir)
        print(inputs_digest(args.dir))
    elif args.cmd == "official":
        args.out.write_text(json.dumps(run_official(args.dir)) + "\n")
    else:
        print(json.dumps(make_fixture(args.official_python), indent=2))
    return 0


if __name__ == "__main__":
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    sys.exit(main())
