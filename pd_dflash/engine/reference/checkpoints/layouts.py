"""Where each family's tensors sit in a published checkpoint, computed from ``config.json`` alone (no torch).

An expert's payload in the host store is a list of parts (one contiguous tensor each, in slot order); each part
is filled from checkpoint tensors by :class:`Source` records, so a loader can stream bytes from the file
straight into the part. Two published layouts:

- ``Qwen3MoeForCausalLM`` (hub layout, bf16): ``mlp.experts.{e}.{gate,up,down}_proj.weight``; parts
  ``gate_up_proj [2I, H]`` (gate rows, then up rows: transformers' fused layout) and ``down_proj [H, I]``.
- ``GptOssForCausalLM`` as published (MXFP4): ``mlp.experts.{gate_up,down}_proj_{blocks,scales,bias}``, each
  ``[E, ...]``; the parts are the six tensors as stored (FP4 blocks + E8M0 scales + bf16 biases). A gpt-oss
  checkpoint saved dense (``gate_up_proj [E, H, 2I]`` ...) is read as stored too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pd_dflash.errors import InputError

#: Supported architectures (``config.json: architectures[0]``) → model_type.
ARCHITECTURES = {"Qwen3MoeForCausalLM": "qwen3_moe", "GptOssForCausalLM": "gpt_oss"}
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
        if self.family == "gpt_oss":
            return [
                Source(i, f"{prefix}.{p.name}", (self.num_experts, *p.shape))
                for i, p in enumerate(self.parts)
            ]
        inter = self.parts[0].shape[0] // 2
        hidden = self.parts[0].shape[1]
        out = []
        for e in range(self.num_experts):
            out.append(Source(0, f"{prefix}.{e}.gate_proj.weight", (inter, hidden), e, 0))
            out.append(Source(0, f"{prefix}.{e}.up_proj.weight", (inter, hidden), e, inter))
            out.append(Source(1, f"{prefix}.{e}.down_proj.weight", (hidden, inter), e, 0))
        return out

    def is_expert_tensor(self, name: str) -> bool:
        return ".mlp.experts." in name


def config_dtype(config: dict[str, Any]) -> str:
    """The checkpoint's floating dtype from config.json (``dtype``, older ``torch_dtype``), default bf16."""
    name = config.get("dtype") or config.get("torch_dtype") or "bfloat16"
    return _CONFIG_DTYPES.get(str(name).replace("torch.", ""), "BF16")


def architecture_of(config: dict[str, Any], where: str) -> str:
    archs = config.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in ARCHITECTURES:
        raise InputError(
            f"architectures: {arch!r} is not supported by the reference engine "
            f"(supported: {', '.join(ARCHITECTURES)})",
            where=where,
        )
    if config.get("model_type") not in (None, ARCHITECTURES[arch]):
        raise InputError(
            f"model_type: {config.get('model_type')!r} does not match architecture {arch}", where=where
        )
    return arch


def quant_method(config: dict[str, Any]) -> str | None:
    q = config.get("quantization_config")
    return q.get("quant_method") if isinstance(q, dict) else None


def expert_layout(
    config: dict[str, Any], *, where: str = "config.json", dtype: str | None = None
) -> ExpertLayout:
    """The expert layout a checkpoint with this config.json has (``dtype``: the stored float dtype, e.g. read
    from the checkpoint; default the config's)."""
    arch = architecture_of(config, where)
    family = ARCHITECTURES[arch]
    fdtype = dtype or config_dtype(config)
    try:
        hidden = int(config["hidden_size"])
        layers = int(config["num_hidden_layers"])
        # Published Qwen3-MoE configs say num_experts; transformers 5 writes num_local_experts.
        experts = int(config.get("num_experts") or config["num_local_experts"])
        inter = int(config["moe_intermediate_size" if family == "qwen3_moe" else "intermediate_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise InputError(f"missing or invalid field {exc}", where=where) from None
    method = quant_method(config)
    if method not in (None, "mxfp4") or (method == "mxfp4" and family != "gpt_oss"):
        raise InputError(
            f"quantization_config.quant_method: {method!r} is not supported for {arch} "
            "(supported: unquantized, or mxfp4 for GptOssForCausalLM)",
            where=where,
        )
    if family == "qwen3_moe":
        step = int(config.get("decoder_sparse_step", 1) or 1)
        dense = set(config.get("mlp_only_layers") or [])
        moe = tuple(i for i in range(layers) if i not in dense and experts > 0 and (i + 1) % step == 0)
        parts = (
            Part("gate_up_proj", (2 * inter, hidden), fdtype),
            Part("down_proj", (hidden, inter), fdtype),
        )
        return ExpertLayout(arch, family, fdtype.lower(), moe, experts, parts)
    moe = tuple(range(layers))
    if method == "mxfp4":
        if hidden % MXFP4_GROUP or inter % MXFP4_GROUP:
            raise InputError(
                f"hidden_size {hidden} and intermediate_size {inter} must be multiples of {MXFP4_GROUP} for MXFP4",
                where=where,
            )
        g_h, g_i = hidden // MXFP4_GROUP, inter // MXFP4_GROUP
        parts = (
            Part("gate_up_proj_blocks", (2 * inter, g_h, 16), "U8"),
            Part("gate_up_proj_scales", (2 * inter, g_h), "U8"),
            Part("gate_up_proj_bias", (2 * inter,), fdtype),
            Part("down_proj_blocks", (hidden, g_i, 16), "U8"),
            Part("down_proj_scales", (hidden, g_i), "U8"),
            Part("down_proj_bias", (hidden,), fdtype),
        )
        return ExpertLayout(arch, family, "mxfp4", moe, experts, parts)
    parts = (
        Part("gate_up_proj", (hidden, 2 * inter), fdtype),
        Part("gate_up_proj_bias", (2 * inter,), fdtype),
        Part("down_proj", (inter, hidden), fdtype),
        Part("down_proj_bias", (hidden,), fdtype),
    )
    return ExpertLayout(arch, family, fdtype.lower(), moe, experts, parts)


def non_expert_tensors(config: dict[str, Any], layout: ExpertLayout) -> list[str]:
    """The non-expert tensors every checkpoint of this family must hold (the plan-time completeness check;
    the loader also checks every parameter of the built model)."""
    arch = layout.family
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.get("tie_word_embeddings", False):
        names.append("lm_head.weight")
    attn = ["q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"]
    if arch == "gpt_oss":
        attn += ["q_proj.bias", "k_proj.bias", "v_proj.bias", "o_proj.bias", "sinks"]
        router = ["mlp.router.weight", "mlp.router.bias"]
    else:
        attn += ["q_norm.weight", "k_norm.weight"]
        router = ["mlp.gate.weight"]
    for i in range(int(config["num_hidden_layers"])):
        p = f"model.layers.{i}"
        names += [f"{p}.input_layernorm.weight", f"{p}.post_attention_layernorm.weight"]
        names += [f"{p}.self_attn.{a}" for a in attn]
        if i in layout.moe_layers:
            names += [f"{p}.{r}" for r in router]
    return names
