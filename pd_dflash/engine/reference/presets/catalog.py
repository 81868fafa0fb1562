"""Model presets: transformers 5.x MoE classes built offline from a config, with the real targets' routing
shape (experts per layer E, top-k) and a width and depth small enough to train and run on 2 CPU cores.

Each preset names its synthetic language and a FIXED training budget (steps, batch, learning rate), so a
preset + seed always yields the same weights (training.py caches them on disk).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from pd_dflash.engine.reference.families import family_named
from pd_dflash.engine.reference.presets.language import SyntheticLanguage


def _known_family(name: str) -> str:
    family_named(name)  # ValueError naming the known families
    return name


#: A model family of ``families.FAMILIES`` (its ``model_type``).
Family = Annotated[str, AfterValidator(_known_family)]


class Preset(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    family: Family
    #: What routing shape it keeps (documentation only).
    mirrors: str
    layers: Annotated[int, Field(ge=1)]
    hidden: Annotated[int, Field(ge=8)]
    heads: Annotated[int, Field(ge=1)]
    kv_heads: Annotated[int, Field(ge=1)]
    head_dim: Annotated[int, Field(ge=2)]
    experts: Annotated[int, Field(ge=2)]
    top_k: Annotated[int, Field(ge=1)]
    expert_intermediate: Annotated[int, Field(ge=1)]
    language: SyntheticLanguage
    train_steps: Annotated[int, Field(ge=1)]
    batch: Annotated[int, Field(ge=1)] = 16
    seq_len: Annotated[int, Field(ge=4)] = 64
    lr: Annotated[float, Field(gt=0)] = 3e-3
    warmup_steps: Annotated[int, Field(ge=0)] = 20
    router_aux_loss_coef: Annotated[float, Field(ge=0)] = 0.01
    max_positions: Annotated[int, Field(ge=16)] = 2048


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            name="micro",
            family="qwen3_moe",
            mirrors="fast tests (Qwen3-MoE class, E=8, k=2)",
            layers=2,
            hidden=64,
            heads=4,
            kv_heads=2,
            head_dim=16,
            experts=8,
            top_k=2,
            expert_intermediate=32,
            language=SyntheticLanguage(modes=4, mode_vocab=16),
            train_steps=120,
            lr=1e-2,
        ),
        Preset(
            name="mini-qwen3-coder",
            family="qwen3_moe",
            mirrors="Qwen3-Coder-30B-A3B routing (E=128, k=8)",
            layers=3,
            hidden=64,
            heads=4,
            kv_heads=2,
            head_dim=16,
            experts=128,
            top_k=8,
            expert_intermediate=32,
            language=SyntheticLanguage(modes=8, mode_vocab=16),
            train_steps=220,
            lr=1e-2,
        ),
        Preset(
            name="mini-gpt-oss",
            family="gpt_oss",
            mirrors="gpt-oss-20b routing (E=32, k=4; alternating sliding/full attention, sinks, biased experts)",
            layers=4,
            hidden=64,
            heads=4,
            kv_heads=2,
            head_dim=16,
            experts=32,
            top_k=4,
            expert_intermediate=64,
            language=SyntheticLanguage(modes=8, mode_vocab=16),
            train_steps=200,
            lr=1e-2,
        ),
        Preset(
            name="mini-mixtral",
            family="mixtral",
            mirrors="Mixtral-8x7B routing (E=8, k=2)",
            layers=4,
            hidden=64,
            heads=4,
            kv_heads=2,
            head_dim=16,
            experts=8,
            top_k=2,
            expert_intermediate=64,
            language=SyntheticLanguage(modes=4, mode_vocab=16),
            train_steps=200,
            lr=1e-2,
        ),
    )
}


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise KeyError(f"unknown reference preset {name!r}; known presets: {', '.join(PRESETS)}")
    return PRESETS[name]


def build_config(preset: Preset):
    """The transformers config of a preset (built offline; no hub access): the fields every family takes,
    then the family's own (``MoEFamily.preset_config``)."""
    common = {
        "vocab_size": preset.language.vocab_size,
        "hidden_size": preset.hidden,
        "num_hidden_layers": preset.layers,
        "num_attention_heads": preset.heads,
        "num_key_value_heads": preset.kv_heads,
        "head_dim": preset.head_dim,
        "num_experts_per_tok": preset.top_k,
        "max_position_embeddings": preset.max_positions,
        "router_aux_loss_coef": preset.router_aux_loss_coef,
        "output_router_logits": False,
        "tie_word_embeddings": False,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
    }
    return family_named(preset.family).preset_config(
        common, experts=preset.experts, intermediate=preset.expert_intermediate
    )


def model_class(family: str) -> type:
    """The family's transformers ``*ForCausalLM`` class (``MoEFamily.model_class``)."""
    return family_named(family).model_class()
