"""Loading a real-shaped checkpoint slice: peak host memory and read throughput of the streaming loader.

Writes a slice of each Phase-A target into a temporary directory — the published config.json with the layer
count cut (Qwen3-Coder-30B-A3B: bf16 hub layout; gpt-oss-20b: MXFP4 experts as published; full vocabulary, so a
one-layer slice is ~2.5 GB) — then, each in a fresh interpreter:

- ``read``: a plain sequential read of the same safetensors files (64 MiB ``readinto``), the reference speed;
- ``read_whole``: each file read whole into new memory (I/O plus first-touch of as much memory as a load fills);
- ``alloc``: only allocating and populating that much fresh host memory (what no loader can avoid);
- ``load``: ``checkpoints.loader.load_checkpoint`` (the engine's load: model skeleton on ``meta``, experts
  streamed into the host store, the rest to the device), recording the process's peak RSS (``VmHWM``).

Printed: peak RSS during the load ÷ checkpoint bytes (target ≤ 1.15; both the peak above the interpreter's
own RSS before the load and the absolute peak) and load throughput ÷ sequential-read throughput (target ≥ 0.8),
from a warm page cache and, with ``--cold``, after dropping each file from the page cache
(``posix_fadvise(DONTNEED)``, no root needed). Results and the command: docs/reference-engine.md.

    .venv/bin/python benchmarks/load.py [--targets qwen3-coder gpt-oss] [--layers 1] [--cold] [--device cpu]
    .venv/bin/python benchmarks/load.py --write-slice gpt-oss DIR   # only write a slice (gpu_check uses it)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

#: The published config.json files of the two targets (fields transformers 5 reads).
PUBLISHED = {
    "qwen3-coder": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "attention_bias": False,
        "decoder_sparse_step": 1,
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "max_position_embeddings": 262144,
        "mlp_only_layers": [],
        "moe_intermediate_size": 768,
        "norm_topk_prob": True,
        "num_attention_heads": 32,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 48,
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-06,
        "rope_theta": 10000000,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "vocab_size": 151936,
    },
    "gpt-oss": {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "attention_bias": True,
        "eos_token_id": 200002,
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": 2880,
        "intermediate_size": 2880,
        "layer_types": ["sliding_attention", "full_attention"] * 12,
        "max_position_embeddings": 131072,
        "num_attention_heads": 64,
        "num_experts_per_tok": 4,
        "num_hidden_layers": 24,
        "num_key_value_heads": 8,
        "num_local_experts": 32,
        "pad_token_id": 199999,
        "quantization_config": {
            "modules_to_not_convert": [
                "model.layers.*.self_attn",
                "model.layers.*.mlp.router",
                "model.embed_tokens",
                "lm_head",
            ],
            "quant_method": "mxfp4",
        },
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "rope_type": "yarn",
            "truncate": False,
        },
        "rope_theta": 150000,
        "sliding_window": 128,
        "swiglu_limit": 7.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "vocab_size": 201088,
    },
}
CHUNK = 64 * 1024 * 1024


def slice_config(target: str, layers: int) -> dict:
    config = dict(PUBLISHED[target], num_hidden_layers=layers)
    if "layer_types" in config:
        config["layer_types"] = config["layer_types"][:layers]
    return config


def tensor_plan(config: dict) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, safetensors dtype, shape) of every tensor the checkpoint holds: the model's non-expert parameters
    (built on meta) and the expert tensors of the published layout."""
    import torch
    from transformers import AutoConfig

    from pd_dflash.engine.reference.families import expert_layout

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        hf_config = AutoConfig.from_pretrained(tmp)
    if hasattr(hf_config, "quantization_config"):
        del hf_config.quantization_config
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16)
    plan = [(n, "BF16", tuple(p.shape)) for n, p in model.named_parameters() if ".mlp.experts." not in n]
    layout = expert_layout(config)
    for layer in layout.moe_layers:
        plan += [(s.tensor, layout.parts[s.part].dtype, s.shape) for s in layout.sources(layer)]
    return plan


def write_slice(target: str, directory: Path, layers: int = 1, shard_bytes: int = 1 << 30) -> int:
    """Write the slice (random but well-scaled values) into ``directory``; returns the checkpoint bytes."""
    import torch

    directory.mkdir(parents=True, exist_ok=True)
    config = slice_config(target, layers)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    gen = torch.Generator().manual_seed(0)
    patterns = {
        "BF16": (torch.randn(CHUNK // 2, generator=gen) * 0.02).to(torch.bfloat16).view(torch.uint8).numpy(),
        "blocks": torch.randint(0, 256, (CHUNK,), generator=gen, dtype=torch.uint8).numpy(),
        "scales": torch.randint(119, 124, (CHUNK,), generator=gen, dtype=torch.uint8).numpy(),
    }
    sizes = {"BF16": 2, "U8": 1}
    shards: list[list[tuple[str, str, tuple[int, ...], int]]] = [[]]
    used = 0
    for name, dtype, shape in tensor_plan(config):
        nbytes = sizes[dtype]
        for d in shape:
            nbytes *= d
        if used and used + nbytes > shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append((name, dtype, shape, nbytes))
        used += nbytes
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        total += _write_shard(directory / file, shard, patterns)
        weight_map.update({name: file for name, *_ in shard})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return total


def _write_shard(path: Path, tensors, patterns) -> int:
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, dtype, shape, nbytes in tensors:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for name, dtype, _shape, nbytes in tensors:
            kind = "BF16" if dtype == "BF16" else ("scales" if name.endswith("_scales") else "blocks")
            pattern = patterns[kind]
            left = nbytes
            while left:
                n = min(left, len(pattern))
                f.write(pattern[:n].tobytes())
                left -= n
    return offset


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _drop_cache(files: list[Path]) -> None:
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def child_read(directory: Path) -> dict:
    """The plain sequential read: every file through one reused 64 MiB buffer (I/O only)."""
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    total, start = 0, time.perf_counter()
    for path in sorted(directory.glob("*.safetensors")):
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(view):
                total += n
    seconds = time.perf_counter() - start
    return {"bytes": total, "seconds": seconds}


def child_read_whole(directory: Path) -> dict:
    """Each file read whole into new memory (``f.read()``): I/O plus first-touch of as much host memory as a
    loader must fill, the least any loader can do."""
    total, start = 0, time.perf_counter()
    keep = []
    for path in sorted(directory.glob("*.safetensors")):
        with open(path, "rb", buffering=0) as f:
            keep.append(f.read())
            total += len(keep[-1])
    seconds = time.perf_counter() - start
    return {"bytes": total, "seconds": seconds}


def child_alloc(directory: Path) -> dict:
    """Fresh host memory as large as the checkpoint, allocated and populated as the loader allocates it
    (``checkpoints.store.host_empty``, 1 GiB at a time): the part of a load no reader can avoid."""
    import torch

    from pd_dflash.engine.reference.checkpoints.store import host_empty

    total = sum(p.stat().st_size for p in directory.glob("*.safetensors"))
    keep, left, start = [], total, time.perf_counter()
    while left:
        n = min(left, 1 << 30)
        keep.append(host_empty((n,), torch.uint8))
        left -= n
    return {"bytes": total, "seconds": time.perf_counter() - start}


def child_load(directory: Path, device: str) -> dict:
    import torch
    import transformers  # imports are a fixed cost, not load throughput: done before the clock starts

    from pd_dflash.engine.reference.checkpoints.fields import read_target_config
    from pd_dflash.engine.reference.checkpoints.loader import load_checkpoint

    arch = read_target_config(directory)["architectures"][0]
    getattr(transformers, arch)
    dev = torch.device(device)
    rss_before = _rss_kib("VmRSS") * 1024
    start = time.perf_counter()
    loaded = load_checkpoint(directory.name, str(directory), device=dev, pin=dev.type == "cuda")
    if dev.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return {
        "bytes": loaded.card["checkpoint_bytes"],
        "seconds": seconds,
        "rss_before": rss_before,
        "peak_rss": _rss_kib("VmHWM") * 1024,
        "storage": loaded.store.storage,
        "expert_nbytes": loaded.store.expert_nbytes,
    }


def _child(mode: str, directory: Path, device: str, cold: bool) -> dict:
    cmd = [sys.executable, __file__, "--child", mode, str(directory), "--device", device]
    if cold:
        _drop_cache(sorted(directory.glob("*.safetensors")))
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{mode} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure(target: str, directory: Path, device: str, cold: bool, repeats: int) -> dict:
    reads, wholes, allocs, loads = [], [], [], []
    for _ in range(repeats):  # interleaved, best of each: the machine's load varies
        reads.append(_child("read", directory, device, cold))
        wholes.append(_child("read_whole", directory, device, cold))
        allocs.append(_child("alloc", directory, device, False))
        loads.append(_child("load", directory, device, cold))
    read = min(reads, key=lambda r: r["seconds"])
    whole = min(wholes, key=lambda r: r["seconds"])
    alloc = min(allocs, key=lambda r: r["seconds"])
    load = min(loads, key=lambda r: r["seconds"])
    ckpt = load["bytes"]
    peak = max(r["peak_rss"] for r in loads)
    above = max(r["peak_rss"] - r["rss_before"] for r in loads)
    return {
        "target": target,
        "page_cache": "cold" if cold else "warm",
        "checkpoint_bytes": ckpt,
        "storage": load["storage"],
        "expert_nbytes": load["expert_nbytes"],
        "read_gbps": read["bytes"] / read["seconds"] / 1e9,
        "load_gbps": ckpt / load["seconds"] / 1e9,
        "throughput_ratio": (ckpt / load["seconds"]) / (read["bytes"] / read["seconds"]),
        "read_whole_gbps": whole["bytes"] / whole["seconds"] / 1e9,
        "fresh_memory_gbps": alloc["bytes"] / alloc["seconds"] / 1e9,
        "throughput_ratio_vs_read_whole": (ckpt / load["seconds"]) / (whole["bytes"] / whole["seconds"]),
        "peak_rss_over_ckpt": above / ckpt,
        "peak_rss_absolute_over_ckpt": peak / ckpt,
        "rss_before_load": load["rss_before"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--targets", nargs="+", choices=sorted(PUBLISHED), default=["qwen3-coder", "gpt-oss"])
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--cold", action="store_true", help="also measure from a cold page cache")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dir", type=Path, help="where to write the slices (default: a temporary directory)")
    parser.add_argument("--write-slice", nargs=2, metavar=("TARGET", "DIR"))
    parser.add_argument("--child", nargs=2, metavar=("MODE", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        mode, directory = args.child
        fn = {"read": child_read, "read_whole": child_read_whole}.get(mode) or (
            lambda d: child_load(d, args.device)
        )
        print(json.dumps(fn(Path(directory))))
        return
    if args.write_slice:
        print(write_slice(args.write_slice[0], Path(args.write_slice[1]), args.layers))
        return
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for target in args.targets:
            directory = Path(tmp) / target
            start = time.perf_counter()
            nbytes = write_slice(target, directory, args.layers)
            print(
                f"{target}: wrote a {args.layers}-layer slice, {nbytes / 1e9:.2f} GB in {time.perf_counter() - start:.0f} s"
            )
            for cold in [False, True] if args.cold else [False]:
                r = measure(target, directory, args.device, cold, args.repeats)
                print(
                    f"  {r['page_cache']:>4} page cache: load {r['load_gbps']:.2f} GB/s vs sequential read "
                    f"{r['read_gbps']:.2f} GB/s -> throughput ratio {r['throughput_ratio']:.2f} (target >= 0.8; "
                    f"vs reading each file whole into new memory, {r['read_whole_gbps']:.2f} GB/s: "
                    f"{r['throughput_ratio_vs_read_whole']:.2f}; fresh host memory alone "
                    f"{r['fresh_memory_gbps']:.2f} GB/s); "
                    f"peak RSS during load / checkpoint bytes {r['peak_rss_over_ckpt']:.3f} (target <= 1.15; "
                    f"absolute {r['peak_rss_absolute_over_ckpt']:.3f} incl. {r['rss_before_load'] / 1e6:.0f} MB "
                    f"of interpreter before the load); {r['storage']} experts, {r['expert_nbytes']} B each"
                )
                print("  " + json.dumps(r))
            subprocess.run(["rm", "-rf", str(directory)], check=False)


if __name__ == "__main__":
    main()
