"""Reading and durably appending row files.

``rows.jsonl`` (one JSON row per line) is the source of truth of a sweep. The report also reads upstream's
raw row files: a JSON list of rows or a single row object.

An append is all-or-nothing: the row goes out in one ``write`` loop followed by fsync, and if anything fails
(a full disk, an I/O error, a file-size limit, an interrupt) the file is truncated back to the offset it had
before, so a failed append leaves no partial line for the next one to land on. Only a process killed in the
middle of a write can leave a torn last line; :func:`repair_tail` moves it aside (resume calls it). A last row
that is complete but lacks its newline is a row: it is read, kept by the repair, and the next append starts a
new line.

Files created here (``rows.jsonl``, the ``.torn`` side file, every :func:`write_atomic` target) get mode
:data:`FILE_MODE` (0640: owner read/write, group read, nothing for others; a stricter umask narrows it).
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import secrets
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, TextIO

from pd_dflash.errors import InputError
from pd_dflash.safe_load import (
    MAX_DEPTH,
    MAX_DOCUMENT_BYTES,
    MalformedText,
    decode_utf8,
    load_json,
    read_bounded,
    read_line_bounded,
    value_depth,
)
from pd_dflash.schema import Row, parse_row

#: The file name of a sweep's rows inside its results directory (written by the collector, read by report).
ROWS_FILE = "rows.jsonl"
#: Mode of every file this module creates (before the umask, which can only make it stricter).
FILE_MODE = 0o640


@dataclass(frozen=True)
class TornTail:
    """A last line that is not valid JSON (a write cut by a crash): its byte offset and text."""

    offset: int
    text: str


@dataclass(frozen=True)
class TailRepair:
    """What :func:`repair_tail` did to the end of a rows file."""

    #: "torn": an incomplete last line was moved aside; "newline": a complete last row got its newline.
    kind: str
    offset: int
    #: Bytes moved aside (torn) or 0.
    size: int = 0
    #: Where the torn bytes were kept (``<file>.torn``), or None.
    aside: Path | None = None

    def describe(self) -> str:
        if self.kind == "newline":
            return f"added the newline missing after the last row (offset {self.offset})"
        return f"moved an incomplete last line ({self.size} bytes at offset {self.offset}) to {self.aside}"


# -- reading ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RowSource:
    """Where a row was read: ``label`` names it in messages (``file:line``, ``file[i]`` or ``file``); JSONL
    rows also have their byte ``offset``, ``length`` and ``digest``, so a reader can fetch the row again
    (:func:`read_line_at`) and know it is the row it read."""

    path: Path
    label: str
    offset: int | None = None
    length: int | None = None
    digest: bytes | None = None
    #: The open file the row was read from, when the reader holds it (``iter_rows(..., hold=...)``): a file
    #: replaced meanwhile (a rename over it) is then still read as it was.
    handle: BinaryIO | None = field(default=None, compare=False, repr=False)


def _digest(line: bytes) -> bytes:
    return hashlib.blake2b(line, digest_size=16).digest()


def _open_error(path: Path, exc: OSError) -> InputError:
    return InputError(f"cannot read rows: {exc.strerror or exc}", where=str(path))


def _rewind(fh: BinaryIO, path: Path) -> None:
    try:
        fh.seek(0)
    except OSError as exc:  # a pipe: the report reads a file twice at most through one handle
        raise InputError(
            f"cannot read rows: not a seekable file ({exc.strerror or exc})", where=str(path)
        ) from None


def _whole_json(fh: BinaryIO, path: Path) -> list[tuple[Row, RowSource]] | None:
    """A JSON list of rows or one row object, or None when the file is not one JSON document (JSON lines)."""
    raw = read_bounded(
        fh, MAX_DOCUMENT_BYTES, where=str(path), what="a row file read whole (JSON, not lines)"
    )
    constants: list[str] = []
    try:
        data = load_json(decode_utf8(raw, where=str(path)), where=str(path), constants=constants)
    except MalformedText:
        return None  # maybe JSON lines after all: they name the line that is wrong
    if isinstance(data, list):
        rows = [
            (parse_row(obj, where=f"{path}[{i}]"), RowSource(path, f"{path}[{i}]"))
            for i, obj in enumerate(data)
        ]
    else:
        rows = [(parse_row(data, where=str(path)), RowSource(path, str(path)))]
    _no_constants(constants, str(path))
    return rows


def _row(obj: Any, where: str, constants: list[str]) -> Row:
    row = parse_row(obj, where=where)
    _no_constants(constants, where)
    return row


def _no_constants(constants: list[str], where: str) -> None:
    """NaN/Infinity where no schema looks (a free-form field): JSON has no such number, so refuse it."""
    if constants:
        raise InputError(f"{constants[0]} in a free-form field: JSON has no such number", where=where)


def _rest_is_blank(fh, chunk: int = 1 << 20) -> bool:
    while block := fh.read(chunk):
        if block.strip():
            return False
    return True


def _open_rows(path: Path):
    try:
        return open(path, "rb")  # the caller's with-statement (or ExitStack) closes it
    except OSError as exc:
        raise _open_error(path, exc) from None


def _iter_jsonl(
    fh: BinaryIO, path: Path, tolerate: bool, torn: list[TornTail], held: bool
) -> Iterator[tuple[Row, RowSource]]:
    offset = lineno = 0
    while line := read_line_bounded(fh, where=f"{path}:{lineno + 1}"):
        lineno += 1
        start, offset = offset, offset + len(line)
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        constants: list[str] = []
        try:
            obj = load_json(decode_utf8(line, where=where), where=where, constants=constants)
        except MalformedText as exc:
            if not _rest_is_blank(fh):
                raise
            if not tolerate:
                hint = " (torn last line: a write cut by a crash; `pd-dflash run --resume` repairs it)"
                raise InputError(exc.message + hint, where=where) from None
            torn.append(TornTail(offset=start, text=line.decode("utf-8", "replace").rstrip("\n")))
            return
        source = RowSource(path, where, start, len(line), _digest(line), fh if held else None)
        yield _row(obj, where, constants), source


def _rows_of(
    path: Path, tolerate: bool, torn: list[TornTail], hold: ExitStack | None = None
) -> Iterator[tuple[Row, RowSource]]:
    """The rows of one file through one open handle (the file is opened once, whatever its form)."""
    fh = _open_rows(path)
    if hold is not None:
        hold.enter_context(fh)
    try:
        head = fh.read(4096)
        _rewind(fh, path)
        if path.suffix != ".jsonl" and head.lstrip()[:1] in (b"[", b"{"):
            whole = _whole_json(fh, path)
            if whole is not None:
                yield from whole
                return
            _rewind(fh, path)
        yield from _iter_jsonl(fh, path, tolerate, torn, hold is not None)
    except OSError as exc:  # EIO and the like, while reading
        raise _open_error(path, exc) from None
    finally:
        if hold is None:
            fh.close()


def iter_rows(path: str | Path, *, hold: ExitStack | None = None) -> Iterator[tuple[Row, RowSource]]:
    """Every row of a ``.jsonl`` file (streamed line by line), a JSON list, or a single JSON object, with
    where it came from. Errors name the file and line; a torn last line is one of them. With ``hold`` the file
    stays open (until ``hold`` closes) and every JSON-lines row's source reads it again through that handle."""
    yield from _rows_of(Path(path), False, [], hold)


def read_rows(path: str | Path, *, tolerate_torn_tail: bool = False) -> tuple[list[Row], TornTail | None]:
    """All rows of a row file (see :func:`iter_rows`). With ``tolerate_torn_tail`` (resume) a torn last line
    is returned instead of raised; the report treats it as the error it is."""
    torn: list[TornTail] = []
    rows = [r for r, _ in _rows_of(Path(path), tolerate_torn_tail, torn)]
    return rows, (torn[0] if torn else None)


def read_line_at(source: RowSource) -> str:
    """The stored text of the JSON-lines row ``source`` points at (read again from its offset, through the held
    handle when there is one), without its newline: the row exactly as the file holds it. A line that is no
    longer the one first read (the file was rewritten in place) is an InputError: a matrix never mixes two
    versions of its input."""
    if source.offset is None:
        raise ValueError(f"{source.label} has no offset (not a JSON lines row)")
    if source.handle is not None and not source.handle.closed:
        line = os.pread(source.handle.fileno(), source.length, source.offset)
    else:
        with _open_rows(source.path) as fh:
            fh.seek(source.offset)
            line = (
                read_line_bounded(fh, where=source.label) if source.length is None else fh.read(source.length)
            )
    if source.digest is not None and _digest(line) != source.digest:
        raise InputError(
            "the file changed while it was being read (this line is no longer the row read first); nothing "
            "was written: report again once the file is complete",
            where=source.label,
        )
    return decode_utf8(line, where=source.label).rstrip("\r\n")


# -- appending and repairing ------------------------------------------------------------------------------


class UnsafeAppend(OSError):
    """The rows file does not end where a row may be appended (an unrepaired torn line)."""


def _line_before(fd: int, end: int, chunk: int = 1 << 16) -> tuple[int, bytes]:
    """The last line of the file (without the newline before it) and its offset, read backwards."""
    pos, tail = end, b""
    while pos > 0:
        step = min(chunk, pos)
        pos -= step
        tail = os.pread(fd, step, pos) + tail
        cut = tail.rfind(b"\n")
        if cut >= 0:
            return pos + cut + 1, tail[cut + 1 :]
    return 0, tail


def _is_complete_row(line: bytes) -> bool:
    try:
        value = json.loads(line)
    except (ValueError, RecursionError):
        return False
    return isinstance(value, dict) and value_depth(value) <= MAX_DEPTH


def _separator(fd: int, end: int, path: Path) -> bytes:
    """b"" when the file is empty or ends with a newline; b"\\n" after a complete row lacking one."""
    if end == 0 or os.pread(fd, 1, end - 1) == b"\n":
        return b""
    start, last = _line_before(fd, end)
    if not last.strip() or _is_complete_row(last):
        return b"\n"
    raise UnsafeAppend(
        f"{path} ends with an incomplete line at offset {start}: run `pd-dflash run --resume` to repair it"
    )


def _roll_back(fd: int, offset: int, path: Path, cause: BaseException) -> None:
    try:
        os.ftruncate(fd, offset)
        os.fsync(fd)
    except OSError as again:
        raise OSError(
            f"appending a row to {path} failed ({cause}) and truncating back to offset {offset} failed too "
            f"({again}); `pd-dflash run --resume` repairs the file"
        ) from cause


def encode_row(row: Row) -> bytes:
    """The stored line of a row (compact JSON, upstream field order, trailing newline)."""
    return (json.dumps(row.to_json_dict(), separators=(",", ":"), allow_nan=False) + "\n").encode("utf-8")


def append_row(path: str | Path, row: Row) -> None:
    """Append one row as one line and fsync; on any failure the file is truncated back (all-or-nothing).

    Raises the OSError that stopped it (after the roll-back), or :class:`UnsafeAppend` when the file ends with
    a torn line (repair it first).
    """
    _append_line(Path(path), encode_row(row))


def append_json(path: str | Path, obj: dict[str, Any]) -> None:
    """Append one JSON object as one line, all-or-nothing and durable like :func:`append_row` (events.jsonl).
    JSON has no NaN or inf: a non-finite number in an event is written as its name (``"inf"``)."""
    try:
        text = json.dumps(obj, separators=(",", ":"), allow_nan=False)
    except ValueError:
        text = json.dumps(_named_non_finite(obj), separators=(",", ":"), allow_nan=False)
    _append_line(Path(path), (text + "\n").encode("utf-8"))


def _named_non_finite(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return repr(obj)
    if isinstance(obj, dict):
        return {k: _named_non_finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_named_non_finite(v) for v in obj]
    return obj


def _append_line(path: Path, line: bytes) -> None:
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, FILE_MODE)
    try:
        end = os.fstat(fd).st_size
        data = _separator(fd, end, path) + line
        try:
            while data:
                data = data[os.write(fd, data) :]
            os.fsync(fd)
        except BaseException as exc:  # ENOSPC, EIO, EFBIG, or an interrupt between two writes
            _roll_back(fd, end, path, exc)
            raise
    finally:
        os.close(fd)


def repair_tail(path: str | Path) -> TailRepair | None:
    """Make a rows file end with a complete line: a torn last line is moved to ``<file>.torn`` (appended,
    never lost) and truncated; a complete last row lacking its newline gets one. None when nothing was wrong."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    try:
        end = os.fstat(fd).st_size
        if end == 0 or os.pread(fd, 1, end - 1) == b"\n":
            return None
        start, last = _line_before(fd, end)
        if not last.strip() or _is_complete_row(last):
            os.pwrite(fd, b"\n", end)
            os.fsync(fd)
            return TailRepair("newline", end)
        aside = _keep_aside(path, last)
        os.ftruncate(fd, start)
        os.fsync(fd)
        return TailRepair("torn", start, len(last), aside)
    finally:
        os.close(fd)


def _keep_aside(path: Path, text: bytes) -> Path:
    aside = path.with_name(path.name + ".torn")
    fd = os.open(aside, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, FILE_MODE)
    try:
        data = text + b"\n"
        while data:
            data = data[os.write(fd, data) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    return aside


def repair_torn_tail(path: str | Path, torn: TornTail) -> Path:
    """Move a torn last line (found by ``read_rows(..., tolerate_torn_tail=True)``) aside and truncate it."""
    path = Path(path)
    aside = _keep_aside(path, torn.text.encode("utf-8"))
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    try:
        os.ftruncate(fd, torn.offset)
        os.fsync(fd)
    finally:
        os.close(fd)
    return aside


# -- whole files ------------------------------------------------------------------------------------------


def write_atomic(path: str | Path, content: str | bytes | Callable[[TextIO], None]) -> None:
    """Write a whole file atomically (a new temp file in the same directory, fsync, rename).

    ``content`` is text, bytes, or a function writing text to the file it is given (a large file is then
    never one string). The temp file is created exclusively with mode :data:`FILE_MODE` and removed if
    anything fails, so no temp file outlives a failed write.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    try:
        with open(fd, "wb") as fh:
            if callable(content):
                with io.TextIOWrapper(fh, encoding="utf-8", newline="\n", write_through=False) as text:
                    content(text)
                    text.flush()
                    os.fsync(fd)
            else:
                fh.write(content.encode("utf-8") if isinstance(content, str) else content)
                fh.flush()
                os.fsync(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable (best effort: some filesystems cannot fsync a directory)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems cannot fsync a directory; the rename itself is atomic
    finally:
        os.close(fd)
