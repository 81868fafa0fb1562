"""How an expert layout is described and read, whatever the family (no torch): where each family's tensors sit
is its module's to say (``families/<family>.py``: ``expert_parts``), computed from ``config.json`` alone
(``families.expert_layout``).

An expert's payload in the host store is a list of parts (one contiguous tensor each, in slot order); each part
is filled from checkpoint tensors by :class:`Source` records, so a loader can stream bytes from the file
straight into the part. A part is stored either as one ``[E, ...]`` tensor named after it (gpt-oss's
``mlp.experts.gate_up_proj_blocks``), or, in the hub layout, as per-expert tensors stacked row-wise into it
(``Part.pieces``: Qwen3-MoE's ``mlp.experts.{e}.gate_proj.weight`` then ``up_proj.weight`` make
``gate_up_proj``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: Bytes per element of the part dtypes (safetensors names).
PART_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "U8": 1}
_CONFIG_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
MXFP4_GROUP = 32  # FP4 values per E8M0 scale; 16 bytes of blocks per group


@dataclass(frozen=True)
class Part:
    """One tensor of an expert's payload: its name in slot order, per-expert shape and stored dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    #: Hub layout: the per-expert checkpoint tensors (name after ``experts.{e}.``, rows) stacked row-wise into
    #: this part, in order; empty: the part is stored as one ``[E, *shape]`` tensor named after it.
    pieces: tuple[tuple[str, int], ...] = ()

    @property
    def nbytes(self) -> int:
        n = PART_BYTES[self.dtype]
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class Source:
    """Checkpoint tensor ``tensor`` fills rows ``[row0, row0 + rows)`` of part ``part`` (one expert, when
    ``expert`` is set: a hub-layout tensor) or the whole part for every expert (``expert`` None: an ``[E, ...]``
    tensor, expert e at byte offset e × part bytes)."""

    part: int
    tensor: str
    shape: tuple[int, ...]
    expert: int | None = None
    row0: int = 0


@dataclass(frozen=True)
class ExpertLayout:
    architecture: str
    family: str
    #: "bf16" / "fp16" / "fp32" (as stored) or "mxfp4".
    storage: str
    moe_layers: tuple[int, ...]
    num_experts: int
    parts: tuple[Part, ...]

    @property
    def expert_nbytes(self) -> int:
        """Stored bytes of one expert: what the host store holds and the link moves."""
        return sum(p.nbytes for p in self.parts)

    @property
    def total_bytes(self) -> int:
        return self.expert_nbytes * self.num_experts * len(self.moe_layers)

    def sources(self, layer: int) -> list[Source]:
        """Every checkpoint tensor of one MoE layer's experts and where its bytes go."""
        prefix = f"model.layers.{layer}.mlp.experts"
        out = [
            Source(i, f"{prefix}.{p.name}", (self.num_experts, *p.shape))
            for i, p in enumerate(self.parts)
            if not p.pieces
        ]
        for e in range(self.num_experts):
            for i, p in enumerate(self.parts):
                row0 = 0
                for tensor, rows in p.pieces:
                    out.append(Source(i, f"{prefix}.{e}.{tensor}", (rows, *p.shape[1:]), e, row0))
                    row0 += rows
        return out

    def is_expert_tensor(self, name: str) -> bool:
        return ".mlp.experts." in name


def config_dtype(config: dict[str, Any]) -> str:
    """The checkpoint's floating dtype from config.json (``dtype``, older ``torch_dtype``), default bf16."""
    name = config.get("dtype") or config.get("torch_dtype") or "bfloat16"
    return _CONFIG_DTYPES.get(str(name).replace("torch.", ""), "BF16")


def quant_method(config: dict[str, Any]) -> str | None:
    q = config.get("quantization_config")
    return q.get("quant_method") if isinstance(q, dict) else None
