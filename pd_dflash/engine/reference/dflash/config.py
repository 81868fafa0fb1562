"""A DFlash drafter's ``config.json`` as z-lab publishes it, and its compatibility with a target — no torch.

The published config is a Qwen3 config (``architectures: ["DFlashDraftModel"]``) plus the drafter's own fields,
read the way the official ``dflash`` package reads them: ``dflash_config.<name>`` first, then the top-level
``<name>``. ``target_layer_ids`` are 0-based target decoder layers (the drafter is conditioned on the state
after each), ``mask_token_id`` fills the block after its anchor, ``block_size`` is the trained block (16 when
absent, as upstream). A drafter runs on the target's input embedding and ``lm_head``, so its hidden size and
vocabulary must be the target's; :func:`drafter_problems` says what does not fit, naming both files and fields.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from pd_dflash.engine.reference.checkpoints.fields import read_json_object
from pd_dflash.engine.reference.checkpoints.resolve import hub_snapshot
from pd_dflash.errors import InputError, excerpt

ARCHITECTURE = "DFlashDraftModel"
UNSUPPORTED = {
    "DFlash2DraftModel": "DFlash-2 drafters (dynamic convolutions and a candidate selector) are not supported; "
    "use a DFlashDraftModel drafter",
}
#: ``models[].draft`` naming a tiny random drafter generated for the loaded target (``dflash.tiny``): tests and
#: ``jobs/tiny_real.yaml``. Acceptance of a random drafter is ≈ 1 token per round: machinery only.
TINY_DRAFTER = "tiny-real-dflash"
DEFAULT_BLOCK_SIZE = 16
SUPPORTED_ACTIVATIONS = ("silu",)


class DFlashConfig(BaseModel):
    """The fields of a published drafter config that the drafter's computation depends on."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int | None
    rms_norm_eps: float
    attention_bias: bool
    num_target_layers: int | None
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    block_size: int
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The official default when a config names no layers: evenly spaced over [1, L − 3]."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [round(start + i * (end - start) / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def read_json(path: Path) -> dict[str, Any]:
    """A drafter's ``config.json``: a bounded JSON object (``checkpoints.fields``)."""
    return read_json_object(path, missing="no config.json here")


class _Fields:
    """Reads a drafter config's fields as the official package does (``dflash_config`` first, then the top
    level); a field of the wrong type is an InputError naming it."""

    def __init__(self, raw: Mapping[str, Any], dflash: dict[str, Any], where: str) -> None:
        self.raw, self.dflash, self.where = raw, dflash, where

    def value(self, name: str, default: Any = None) -> Any:
        return self.dflash.get(name, self.raw.get(name, default))

    def field(self, name: str) -> str:
        return f"dflash_config.{name}" if name in self.dflash else name

    def integer(self, name: str, default: Any = None, *, low: int = 1) -> int:
        got = self.value(name, default)
        if isinstance(got, bool) or not isinstance(got, int) or got < low:
            raise InputError(
                f"{self.field(name)} must be an integer ≥ {low}, got {excerpt(got)}", where=self.where
            )
        return got

    def boolean(self, name: str, default: bool = False) -> bool:
        got = self.raw.get(name, default)
        if not isinstance(got, bool):
            raise InputError(f"{name} must be true or false, got {excerpt(got)}", where=self.where)
        return got

    def number(self, name: str, default: float | None) -> float | None:
        got = self.value(name, default)
        if got is None:
            return None
        if isinstance(got, bool) or not isinstance(got, int | float):
            raise InputError(f"{self.field(name)} must be a number, got {excerpt(got)}", where=self.where)
        if not math.isfinite(got):
            raise InputError(f"{self.field(name)} must be finite, got {got!r}", where=self.where)
        return float(got)

    def layer_ids(self, layers: int, num_target: int | None) -> tuple[int, ...]:
        ids = self.value("target_layer_ids")
        if ids is None:
            if num_target is None:
                raise InputError(
                    "dflash_config.target_layer_ids (or num_target_layers) is required", where=self.where
                )
            ids = build_target_layer_ids(num_target, layers)
        if (
            not isinstance(ids, list)
            or not ids
            or any(isinstance(i, bool) or not isinstance(i, int) for i in ids)
        ):
            raise InputError(
                f"dflash_config.target_layer_ids must be a non-empty list of integers, got {excerpt(ids)}",
                where=self.where,
            )
        if len(set(ids)) != len(ids):
            raise InputError(f"dflash_config.target_layer_ids {ids} repeats a layer", where=self.where)
        return tuple(ids)


def _dflash_section(raw: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The ``dflash_config`` object of a DFlashDraftModel config (other architectures are refused)."""
    dflash = raw.get("dflash_config")
    if not isinstance(dflash, dict):
        raise InputError("no dflash_config object: not a DFlash drafter config", where=where)
    arch = raw.get("architectures") or [ARCHITECTURE]
    if not isinstance(arch, list) or not all(isinstance(a, str) for a in arch):
        raise InputError(f"architectures must be a list of class names, got {excerpt(arch)}", where=where)
    if arch[0] in UNSUPPORTED:
        raise InputError(f"architectures {arch}: {UNSUPPORTED[arch[0]]}", where=where)
    if arch[0] != ARCHITECTURE:
        raise InputError(f"architectures {excerpt(arch)}: expected [{ARCHITECTURE!r}]", where=where)
    return dflash


def parse_drafter_config(raw: Mapping[str, Any], where: str) -> DFlashConfig:
    """The drafter config of a published ``config.json`` (``where``: that file, for the errors)."""
    f = _Fields(raw, _dflash_section(raw, where), where)
    hidden, heads, layers = (
        f.integer("hidden_size"),
        f.integer("num_attention_heads"),
        f.integer("num_hidden_layers"),
    )
    kv_heads = f.integer("num_key_value_heads", heads)
    if heads % kv_heads:
        raise InputError(
            f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}", where=where
        )
    act = raw.get("hidden_act", "silu")
    if not isinstance(act, str) or act not in SUPPORTED_ACTIVATIONS:
        raise InputError(
            f"hidden_act {excerpt(act)} is not supported (supported: {SUPPORTED_ACTIVATIONS})", where=where
        )
    num_target = None if f.value("num_target_layers") is None else f.integer("num_target_layers")
    if f.value("mask_token_id") is None:
        raise InputError("dflash_config.mask_token_id is required (the token filling the block)", where=where)
    softcap = f.number("final_logit_softcapping", None)
    return DFlashConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=f.integer("head_dim", hidden // heads),
        intermediate_size=f.integer("intermediate_size"),
        vocab_size=None if raw.get("vocab_size") is None else f.integer("vocab_size"),
        rms_norm_eps=f.number("rms_norm_eps", 1e-6),
        attention_bias=f.boolean("attention_bias"),
        num_target_layers=num_target,
        target_layer_ids=f.layer_ids(layers, num_target),
        mask_token_id=f.integer("mask_token_id", low=0),
        block_size=f.integer("block_size", DEFAULT_BLOCK_SIZE, low=2),
        input_embedding_scale=f.number("input_embedding_scale", 1.0),
        output_multiplier=f.number("output_multiplier", 1.0),
        final_logit_softcapping=None if softcap is None or softcap <= 0 else softcap,
    )


def drafter_problems(
    target: Mapping[str, Any], drafter: DFlashConfig, *, target_where: str, drafter_where: str
) -> list[str]:
    """Why this drafter cannot run on this target (empty when it can). The drafter reads the target's hidden
    states, input embedding and lm_head, so sizes must match exactly."""
    problems = []
    t_hidden, t_vocab, t_layers = (target.get(k) for k in ("hidden_size", "vocab_size", "num_hidden_layers"))
    if drafter.hidden_size != t_hidden:
        problems.append(
            f"{drafter_where}: hidden_size {drafter.hidden_size} differs from the target's {t_hidden} "
            f"({target_where}: hidden_size)"
        )
    if drafter.vocab_size is not None and drafter.vocab_size != t_vocab:
        problems.append(
            f"{drafter_where}: vocab_size {drafter.vocab_size} differs from the target's {t_vocab} "
            f"({target_where}: vocab_size)"
        )
    if isinstance(t_vocab, int) and not drafter.mask_token_id < t_vocab:
        problems.append(
            f"{drafter_where}: dflash_config.mask_token_id {drafter.mask_token_id} is outside the target's "
            f"vocabulary of {t_vocab} ({target_where}: vocab_size)"
        )
    if isinstance(t_layers, int):
        if drafter.num_target_layers is not None and drafter.num_target_layers != t_layers:
            problems.append(
                f"{drafter_where}: num_target_layers {drafter.num_target_layers} differs from the target's "
                f"{t_layers} ({target_where}: num_hidden_layers)"
            )
        bad = [i for i in drafter.target_layer_ids if not 0 <= i < t_layers]
        if bad:
            problems.append(
                f"{drafter_where}: dflash_config.target_layer_ids {list(drafter.target_layer_ids)} has "
                f"{bad} outside the target's layers 0..{t_layers - 1} ({target_where}: num_hidden_layers)"
            )
    return problems


def resolve_drafter(draft: str, env: Mapping[str, str] | None = None) -> tuple[Path | None, list[str]]:
    """(directory or None, where it was looked for) of ``models[].draft``: a local directory, or a hub id
    already in the Hugging Face cache (``HF_HUB_CACHE`` / ``HF_HOME``). Never downloads."""
    env = os.environ if env is None else env
    local = Path(draft).expanduser()
    if local.is_dir():
        return local, [str(local)]
    tried = [str(local)]
    if draft.count("/") == 1 and not draft.startswith((".", "/", "~")):
        snap, repo = hub_snapshot(draft, env)
        tried.append(str(repo))
        if snap is not None:
            return snap, tried
    return None, tried


def check_drafter(
    draft: str,
    target_config: Mapping[str, Any],
    *,
    target_where: str,
    env: Mapping[str, str] | None = None,
    require_present: bool = False,
    block_sizes: Sequence[int] = (),
) -> str | None:
    """Check ``models[].draft`` against its target's ``config.json`` (already read) before anything loads.

    Incompatible or malformed: an InputError naming both files and the fields. Not on this machine: a note
    (``plan`` on a head box without the weights), or an InputError when ``require_present``. A block size of
    ``block_sizes`` above the drafter's trained one: a note (those cells run, each row with a warning). The tiny
    drafter name is generated for the target, so it always fits.
    """
    if not draft or draft == TINY_DRAFTER:
        return None
    directory, tried = resolve_drafter(draft, env)
    if directory is None:
        message = f"DFlash drafter {draft!r} not found here (looked in {', '.join(tried)})"
        if require_present:
            raise InputError(
                message + "; download it into HF_HOME or give a local directory", where="models[].draft"
            )
        return message + "; the runners resolve it on their boxes"
    where = str(directory / "config.json")
    config = parse_drafter_config(read_json(directory / "config.json"), where)
    problems = drafter_problems(target_config, config, target_where=target_where, drafter_where=where)
    if problems:
        raise InputError(
            f"drafter {draft!r} does not fit its target: " + "; ".join(problems), where="models[].draft"
        )
    above = sorted(b for b in block_sizes if b > config.block_size)
    if above:
        return (
            f"DFlash drafter {draft!r} is trained for block size {config.block_size} ({where}: "
            f"dflash_config.block_size); its cells at B = {', '.join(map(str, above))} run with a row warning"
        )
    return None
