"""The safetensors files of a checkpoint, read without torch: each tensor's file, dtype, shape and byte range.

A safetensors file is an 8-byte little-endian header length, a JSON header ``{name: {dtype, shape,
data_offsets: [begin, end]}}`` and the data. A sharded checkpoint adds ``model.safetensors.index.json``
(``weight_map: {name: file}``). Everything a loader needs to stream a tensor straight into its destination is
here, and every inconsistency (a missing shard, a truncated file, a tensor the index names but no shard holds)
is an :class:`~pd_dflash.errors.InputError` naming the file.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

from pd_dflash.engine.reference.checkpoints.fields import read_weight_map
from pd_dflash.errors import InputError, excerpt
from pd_dflash.safe_load import decode_utf8, load_json

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
#: Bytes per element of the safetensors dtypes a checkpoint of a supported family holds.
DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "U8": 1, "I8": 1, "F8_E4M3": 1, "I32": 4, "I64": 8}
_MAX_HEADER = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorEntry:
    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    #: Absolute byte range of the data in ``file``.
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def read_header(path: Path) -> dict[str, TensorEntry]:
    """The tensors of one safetensors file; a short, corrupt or truncated file is an InputError naming it."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise InputError(
                    "not a safetensors file (shorter than its 8-byte header length)", where=str(path)
                )
            (length,) = struct.unpack("<Q", raw)
            if length > min(_MAX_HEADER, size - 8):
                raise InputError(f"not a safetensors file (header length {length} B)", where=str(path))
            raw_header = f.read(length)
    except OSError as exc:
        raise InputError(f"cannot read: {exc.strerror or exc}", where=str(path)) from None
    try:
        header = load_json(decode_utf8(raw_header, where=str(path)), where=str(path))
    except InputError as exc:
        raise InputError(f"corrupt safetensors header: {exc.message}", where=str(path)) from None
    if not isinstance(header, dict):
        raise InputError("corrupt safetensors header: not a JSON object of tensors", where=str(path))
    base = 8 + length
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            _check_metadata(info, path)
            continue
        dtype, shape, (begin, end) = _header_entry(name, info, path)
        entry = TensorEntry(name, path, dtype, shape, base + begin, base + end)
        if dtype in DTYPE_BYTES and entry.nbytes != _numel(shape) * DTYPE_BYTES[dtype]:
            raise InputError(f"tensor {name!r}: {entry.nbytes} B for {dtype}{list(shape)}", where=str(path))
        if entry.end > size:
            raise InputError(
                f"file is truncated: tensor {name!r} ends at byte {entry.end}, the file has {size} B "
                "(an interrupted download?)",
                where=str(path),
            )
        out[name] = entry
    return out


@dataclass(frozen=True)
class CheckpointFiles:
    directory: Path
    tensors: dict[str, TensorEntry]
    #: The safetensors files, in the order a loader should read them.
    files: tuple[Path, ...]

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self.tensors.values())

    def get(self, name: str, field: str) -> TensorEntry:
        """The tensor ``name``; absent, an InputError naming the checkpoint and the missing tensor."""
        entry = self.tensors.get(name)
        if entry is None:
            raise InputError(
                f"tensor {name!r} ({field}) is not in the checkpoint (partial or a different layout?)",
                where=str(self.directory),
            )
        return entry


def open_checkpoint(directory: Path) -> CheckpointFiles:
    """Every tensor of the checkpoint in ``directory`` (sharded with an index, or one model.safetensors)."""
    index = directory / INDEX_FILE
    weight_map: dict[str, str] | None
    if index.is_file():
        weight_map = read_weight_map(index)
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (directory / n).is_file()]
        if missing:
            raise InputError(
                f"{len(missing)} of {len(names)} shards named by {INDEX_FILE} are missing: "
                f"{', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''} (partial download?)",
                where=str(directory),
            )
        files = tuple(directory / n for n in names)
    elif (directory / SINGLE_FILE).is_file():
        weight_map, files = None, (directory / SINGLE_FILE,)
    else:
        raise InputError(
            f"no {SINGLE_FILE} or {INDEX_FILE}: not a safetensors checkpoint (or not downloaded)",
            where=str(directory),
        )
    tensors: dict[str, TensorEntry] = {}
    for path in files:
        tensors.update(read_header(path))
    if weight_map is not None:
        absent = sorted(n for n, f in weight_map.items() if n not in tensors or tensors[n].file.name != f)
        if absent:
            raise InputError(
                f"{len(absent)} tensors named by {INDEX_FILE} are not in their shard, e.g. {absent[0]!r} "
                f"(expected in {weight_map[absent[0]]})",
                where=str(directory),
            )
    return CheckpointFiles(directory, tensors, files)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _header_entry(name: str, info: object, path: Path) -> tuple[str, tuple[int, ...], tuple[int, int]]:
    """(dtype, shape, data_offsets) of one header entry, each of its JSON type (InputError naming the key)."""
    where = str(path)
    if not isinstance(info, dict):
        raise InputError(
            f"tensor {name!r}: header entry must be a JSON object, got {excerpt(info)}", where=where
        )
    missing = [k for k in ("dtype", "shape", "data_offsets") if k not in info]
    if missing:
        raise InputError(f"tensor {name!r}: header entry has no {', '.join(missing)}", where=where)
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str):
        raise InputError(f"tensor {name!r}: dtype must be a string, got {excerpt(dtype)}", where=where)
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise InputError(
            f"tensor {name!r}: shape must be a list of non-negative integers, got {excerpt(shape)}",
            where=where,
        )
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)):
        raise InputError(
            f"tensor {name!r}: data_offsets must be two non-negative integers [begin, end], got {excerpt(offsets)}",
            where=where,
        )
    if offsets[0] > offsets[1]:
        raise InputError(f"tensor {name!r}: data_offsets {offsets} end before they begin", where=where)
    return dtype, tuple(shape), (offsets[0], offsets[1])


def _check_metadata(info: object, path: Path) -> None:
    if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
        raise InputError(
            f"__metadata__ must be a JSON object of strings, got {excerpt(info)}", where=str(path)
        )


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
