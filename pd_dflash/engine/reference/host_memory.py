"""How much host memory one reference-engine runner needs, without torch: the sweep tells Ray (``memory``), so
Ray places no more runners on a box than its memory holds (each runner keeps its own pinned expert arena).

The runner loads the checkpoint whole into host memory (``from_pretrained``), then moves its routed experts
into the host arena (``expert_store.py``) layer by layer, releasing the source as it goes, and the non-expert
weights to the device. The peak is therefore about the checkpoint's weights as loaded: the bytes of its
weight files (``*.safetensors``, else ``*.bin``), scaled when ``engine_options.dtype`` asks for a wider or
narrower dtype than the checkpoint's. Unknown (None: Ray reserves nothing) for a preset (a few MB), a
checkpoint this box cannot see, and a quantized checkpoint (``quantization_config``, e.g. gpt-oss's MXFP4:
its loaded size is not its files' size).
"""

from __future__ import annotations

import json
from pathlib import Path

from pd_dflash.spec import ModelSpec

_DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}


def runner_host_memory_bytes(model: ModelSpec) -> int | None:
    """Peak host bytes of a runner loading ``model`` (see the module doc), or None when not known."""
    if model.preset is not None:
        return None
    path = _local_checkpoint(model.id)
    if path is None:
        return None
    config = _read_json(path / "config.json")
    if config is None or config.get("quantization_config"):
        return None
    files = sorted(path.glob("*.safetensors")) or sorted(path.glob("*.bin"))
    if not files:
        return None
    stored = sum(f.stat().st_size for f in files)
    wanted = str(model.engine_options.get("dtype", "auto"))
    source = str(config.get("torch_dtype") or config.get("dtype") or "")
    if wanted != "auto" and wanted in _DTYPE_BYTES and source in _DTYPE_BYTES:
        stored = stored * _DTYPE_BYTES[wanted] // _DTYPE_BYTES[source]
    return stored


def _local_checkpoint(model_id: str) -> Path | None:
    """A checkpoint directory, or the snapshot of an HF cache entry already on this box (never a download)."""
    path = Path(model_id).expanduser()
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model_id, local_files_only=True))
    except Exception:  # not cached here, not a repo id, or huggingface_hub missing: unknown
        return None


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
