"""The safetensors files of a checkpoint, read without torch: each tensor's file, dtype, shape and byte range.

A safetensors file is an 8-byte little-endian header length, a JSON header ``{name: {dtype, shape,
data_offsets: [begin, end]}}`` and the data. A sharded checkpoint adds ``model.safetensors.index.json``
(``weight_map: {name: file}``). Everything a loader needs to stream a tensor straight into its destination is
here, and every inconsistency (a missing shard, a truncated file, a tensor the index names but no shard holds)
is an :class:`~pd_dflash.errors.InputError` naming the file.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from pd_dflash.errors import InputError

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
            header = json.loads(f.read(length))
    except OSError as exc:
        raise InputError(f"cannot read: {exc.strerror or exc}", where=str(path)) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"corrupt safetensors header: {exc}", where=str(path)) from None
    base = 8 + length
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = (
                info["dtype"],
                tuple(int(d) for d in info["shape"]),
                info["data_offsets"],
            )
        except (KeyError, TypeError, ValueError):
            raise InputError(f"tensor {name!r}: malformed header entry", where=str(path)) from None
        entry = TensorEntry(name, path, dtype, shape, base + int(begin), base + int(end))
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
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise InputError(f"unreadable index: {exc}", where=str(index)) from None
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


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
