"""Reading and durably appending row files.

``rows.jsonl`` (one JSON row per line) is the source of truth of a sweep. The report also reads upstream's
raw row files: a JSON list of rows or a single row object. A row is appended with one ``write`` followed by
flush + fsync, so a crash leaves at most a torn *last* line, which resume detects and repairs.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from pd_dflash.errors import InputError
from pd_dflash.schema import Row, parse_row

#: The file name of a sweep's rows inside its results directory (written by the collector, read by report).
ROWS_FILE = "rows.jsonl"


@dataclass(frozen=True)
class TornTail:
    """A last line that is not valid JSON (a write cut by a crash): its byte offset and text."""

    offset: int
    text: str


def read_rows(path: str | Path, *, tolerate_torn_tail: bool = False) -> tuple[list[Row], TornTail | None]:
    """All rows of a ``.jsonl`` file, a JSON list, or a single JSON object.

    Errors name the file and line. A torn last line of a JSONL file is returned (not raised) only when
    ``tolerate_torn_tail`` is set, for resume; the report treats it as the error it is.
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise InputError(f"cannot read rows: {exc.strerror or exc}", where=str(path)) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"not UTF-8 text: {exc.reason}", where=str(path)) from None
    stripped = text.lstrip()
    if not stripped:
        return [], None
    if path.suffix != ".jsonl" and stripped[0] in "[{":
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            data = None  # maybe JSON lines after all
        else:
            if isinstance(data, list):
                return [parse_row(obj, where=f"{path}[{i}]") for i, obj in enumerate(data)], None
            return [parse_row(data, where=str(path))], None
    return _read_jsonl(path, raw, tolerate_torn_tail)


def _read_jsonl(path: Path, raw: bytes, tolerate_torn_tail: bool) -> tuple[list[Row], TornTail | None]:
    rows: list[Row] = []
    offset = 0
    lines = raw.split(b"\n")
    for lineno, line in enumerate(lines, start=1):
        start = offset
        offset += len(line) + 1
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            is_last = all(not rest.strip() for rest in lines[lineno:])
            if is_last and tolerate_torn_tail:
                return rows, TornTail(offset=start, text=line.decode("utf-8", "replace"))
            hint = (
                " (torn last line: a write cut by a crash; `pd-dflash run --resume` repairs it)"
                if is_last
                else ""
            )
            raise InputError(f"invalid JSON: {exc.msg}{hint}", where=f"{path}:{lineno}") from None
        rows.append(parse_row(obj, where=f"{path}:{lineno}"))
    return rows, None


def append_row(path: str | Path, row: Row) -> None:
    """Append one row as one line, then flush and fsync: a stored row survives a crash of any process."""
    line = json.dumps(row.to_json_dict(), sort_keys=False, separators=(",", ":")) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        data = line.encode("utf-8")
        while data:
            data = data[os.write(fd, data) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def repair_torn_tail(path: str | Path, torn: TornTail) -> Path:
    """Move a torn last line aside (``<file>.torn``, appended, never lost) and truncate it from the file."""
    path = Path(path)
    aside = path.with_name(path.name + ".torn")
    with open(aside, "a", encoding="utf-8") as fh:
        fh.write(torn.text + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    with open(path, "r+b") as fh:
        fh.truncate(torn.offset)
        fh.flush()
        os.fsync(fh.fileno())
    return aside


def write_atomic(path: str | Path, text: str | bytes) -> None:
    """Write a whole file atomically (temp file in the same directory, fsync, rename); text or bytes."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") if isinstance(text, bytes) else open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def append_json(path: str | Path, obj: dict) -> None:
    """Append one JSON object as one line, durably as ``append_row`` (a sweep's ``events.jsonl``)."""
    data = (json.dumps(obj, sort_keys=False, separators=(",", ":")) + "\n").encode("utf-8")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
    try:
        start = os.lseek(fd, 0, os.SEEK_END)
        try:
            while data:
                data = data[os.write(fd, data) :]
            os.fsync(fd)
        except OSError:
            os.ftruncate(fd, start)  # all or nothing: no half line for the next append to continue
            raise
    finally:
        os.close(fd)
