"""The JSON files of a checkpoint, read as untrusted input (no torch): bounded, and every field the engine reads
type-checked, so a malformed file is an :class:`~pd_dflash.errors.InputError` naming the file and the key (exit 2
at ``plan``), never an ``AttributeError`` three calls later.

- ``config.json``: a JSON object; each key below, when present, has its type (``TARGET_FIELDS``); which keys
  a family *requires* is its module's to say (``families/``: ``MoEFamily.layout_dims``, ``expert_parts``);
- ``generation_config.json`` (optional): ``eos_token_id`` an id or a list of ids (each of them stops a request);
- ``tokenizer_config.json`` (optional): a JSON object whose ``chat_template`` is a string or a list of named
  templates;
- ``model.safetensors.index.json``: ``weight_map`` an object of tensor name → shard file name in the directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pd_dflash.errors import InputError, format_validation_error
from pd_dflash.safe_load import decode_utf8, load_json

#: A checkpoint's JSON file larger than this is not one (an index of a 60 GB model is ~2 MB).
MAX_JSON_BYTES = 64 * 2**20

Positive = Annotated[int, Field(ge=1)]
NonNegative = Annotated[int, Field(ge=0)]
TokenIds = NonNegative | Annotated[list[NonNegative], Field(min_length=1)]


class _Quantization(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    quant_method: str | None = None
    modules_to_not_convert: list[str] | None = None


class TargetConfigFields(BaseModel):
    """The ``config.json`` keys the reference engine reads (other keys are transformers' to read)."""

    model_config = ConfigDict(extra="allow", strict=True)

    architectures: Annotated[list[str], Field(min_length=1)] | None = None
    model_type: str | None = None
    hidden_size: Positive | None = None
    num_hidden_layers: NonNegative | None = None
    num_experts: NonNegative | None = None
    num_local_experts: NonNegative | None = None
    num_experts_per_tok: Positive | None = None
    experts_per_token: Positive | None = None
    moe_intermediate_size: Positive | None = None
    intermediate_size: Positive | None = None
    vocab_size: Positive | None = None
    num_attention_heads: Positive | None = None
    num_key_value_heads: Positive | None = None
    head_dim: Positive | None = None
    decoder_sparse_step: Positive | None = None
    mlp_only_layers: list[NonNegative] | None = None
    tie_word_embeddings: bool | None = None
    quantization_config: _Quantization | None = None
    dtype: str | None = None
    torch_dtype: str | None = None
    hidden_act: str | None = None
    rms_norm_eps: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] | None = None
    max_position_embeddings: Positive | None = None
    sliding_window: Positive | None = None
    layer_types: list[str] | None = None
    eos_token_id: TokenIds | None = None
    bos_token_id: TokenIds | None = None
    pad_token_id: TokenIds | None = None


class GenerationConfigFields(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    eos_token_id: TokenIds | None = None
    bos_token_id: TokenIds | None = None
    pad_token_id: TokenIds | None = None


class _NamedTemplate(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    name: str
    template: str


class TokenizerConfigFields(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    chat_template: str | list[_NamedTemplate] | None = None


class IndexFields(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    weight_map: dict[str, Annotated[str, Field(min_length=1)]]
    metadata: dict[str, Any] | None = None


def read_json_object(path: Path, *, missing: str | None = None) -> dict[str, Any]:
    """A bounded JSON object from ``path`` (``missing``: the message when the file is absent)."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_JSON_BYTES + 1)
    except FileNotFoundError:
        raise InputError(missing or "file not found", where=str(path)) from None
    except OSError as exc:
        raise InputError(f"cannot read: {exc.strerror or exc}", where=str(path)) from None
    if len(raw) > MAX_JSON_BYTES:
        raise InputError(f"larger than {MAX_JSON_BYTES} bytes: not a checkpoint's JSON file", where=str(path))
    data = load_json(decode_utf8(raw, where=str(path)), where=str(path))
    if not isinstance(data, dict):
        raise InputError(f"must be a JSON object, got a JSON {_json_type(data)}", where=str(path))
    return data


def checked(model: type[BaseModel], data: dict[str, Any], where: str) -> BaseModel:
    """``data`` through ``model``; a key of the wrong type is an InputError naming the file and the key."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise InputError(format_validation_error(exc), where=where) from None


def read_target_config(directory: Path) -> dict[str, Any]:
    """``config.json`` as a dict whose engine-read keys have their types."""
    path = directory / "config.json"
    config = read_json_object(
        path, missing="no config.json: not a transformers checkpoint (or not downloaded)"
    )
    checked(TargetConfigFields, config, str(path))
    return config


def generation_eos_ids(directory: Path) -> list[int] | None:
    """``generation_config.json: eos_token_id`` as a list (None when the file or the key is absent)."""
    path = directory / "generation_config.json"
    if not path.is_file():
        return None
    fields = checked(GenerationConfigFields, read_json_object(path), str(path))
    eos = fields.eos_token_id
    return None if eos is None else [eos] if isinstance(eos, int) else list(eos)


def has_chat_template(directory: Path) -> bool:
    """A chat template saved beside the tokenizer (``chat_template.jinja``/``.json`` or tokenizer_config.json);
    a tokenizer_config.json that is malformed is an InputError naming it."""
    if (directory / "chat_template.jinja").is_file():
        return True
    if (directory / "chat_template.json").is_file():
        path = directory / "chat_template.json"
        return bool(checked(TokenizerConfigFields, read_json_object(path), str(path)).chat_template)
    path = directory / "tokenizer_config.json"
    if not path.is_file():
        return False
    return bool(checked(TokenizerConfigFields, read_json_object(path), str(path)).chat_template)


def read_weight_map(index: Path) -> dict[str, str]:
    """``weight_map`` of a sharded checkpoint's index: tensor name → a shard file in the same directory."""
    fields = checked(IndexFields, read_json_object(index), str(index))
    for name, shard in fields.weight_map.items():
        if Path(shard).name != shard or shard in (".", ".."):
            raise InputError(
                f"weight_map.{name}: {shard!r} is not a file name in the checkpoint directory",
                where=str(index),
            )
    return fields.weight_map


def _json_type(value: Any) -> str:
    return {list: "list", str: "string", bool: "boolean", int: "number", float: "number"}.get(
        type(value), "null" if value is None else type(value).__name__
    )
