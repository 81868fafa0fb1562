"""Where a tail repair happens, to the byte; reading a missing file; compact event lines (rows.py)."""

from __future__ import annotations

import json
import os

import pytest

from pd_dflash.errors import InputError
from pd_dflash.rows import _line_before, append_json, encode_row, read_rows, repair_tail
from pd_dflash.sweep.resume import current_rows_of
from tests.core.test_rows import row


def test_a_newline_repair_happens_at_the_end_of_the_file(tmp_path):
    path = tmp_path / "rows.jsonl"
    body = encode_row(row(0)) + encode_row(row(1)).rstrip(b"\n")
    path.write_bytes(body)
    repaired = repair_tail(path)
    assert (repaired.kind, repaired.offset, repaired.size, repaired.aside) == ("newline", len(body), 0, None)
    assert path.read_bytes() == body + b"\n"


def test_a_torn_repair_cuts_at_the_start_of_the_torn_line(tmp_path):
    path = tmp_path / "rows.jsonl"
    first = encode_row(row(0))
    path.write_bytes(first + b'{"model": "m')
    repaired = repair_tail(path)
    assert (repaired.kind, repaired.offset, repaired.size) == ("torn", len(first), len(b'{"model": "m'))
    assert repaired.aside == tmp_path / "rows.jsonl.torn"


def test_a_file_that_is_one_torn_byte_is_emptied_and_the_byte_kept(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b"{")
    repaired = repair_tail(path)
    assert (repaired.kind, repaired.offset, repaired.size) == ("torn", 0, 1)
    assert path.read_bytes() == b"" and (tmp_path / "rows.jsonl.torn").read_bytes() == b"{\n"
    assert repair_tail(path) is None  # an empty file needs nothing


def test_the_last_line_is_found_however_small_the_read_chunk(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"ab\ncd")
    fd = os.open(path, os.O_RDONLY)
    try:
        for chunk in (1, 2, 3, 1 << 16):
            assert _line_before(fd, 5, chunk) == (3, b"cd")
            assert _line_before(fd, 2, chunk) == (0, b"ab")  # no newline before: the whole prefix
    finally:
        os.close(fd)


def test_a_missing_rows_file_names_the_file_and_the_reason(tmp_path):
    path = tmp_path / "missing.jsonl"
    with pytest.raises(InputError) as err:
        read_rows(path)
    assert str(err.value) == f"{path}: cannot read rows: No such file or directory"


def test_event_lines_are_compact_json(tmp_path):
    path = tmp_path / "events.jsonl"
    append_json(path, {"event": "requeued", "cells": [1, 2], "cause": "é"})
    append_json(path, {"event": "x"})
    assert path.read_bytes() == (b'{"event":"requeued","cells":[1,2],"cause":"\\u00e9"}\n{"event":"x"}\n')
    assert [json.loads(line)["event"] for line in path.read_text().splitlines()] == ["requeued", "x"]


def test_the_current_rows_of_a_directory_ignore_a_torn_last_line(tmp_path):
    (tmp_path / "rows.jsonl").write_bytes(encode_row(row(0)) + b'{"model": "m')
    assert [r.repeat for r in current_rows_of(tmp_path)] == [0]
    assert current_rows_of(tmp_path / "nowhere") == []


# -- what counts as a complete last row --------------------------------------------------------------------------


def nested(depth: int) -> bytes:
    """A JSON object nesting ``depth`` levels (depth 1 = a flat object): an object around depth - 1 lists."""
    return b'{"a":' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}"


def test_a_complete_last_line_is_an_object_no_deeper_than_the_limit(tmp_path):
    from pd_dflash.safe_load import MAX_DEPTH

    cases = {b"[1, 2]": "torn", nested(MAX_DEPTH): "newline", nested(MAX_DEPTH + 1): "torn"}
    for i, (last, kind) in enumerate(cases.items()):
        path = tmp_path / f"rows{i}.jsonl"
        path.write_bytes(encode_row(row(0)) + last)
        assert repair_tail(path).kind == kind, (last[:20], kind)


def test_the_last_line_after_several_and_at_the_very_start(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"ab\ncd\nef\n\ngh")
    fd = os.open(path, os.O_RDONLY)
    try:
        assert _line_before(fd, 12) == (10, b"gh")
        assert _line_before(fd, 9, 4) == (9, b"")
    finally:
        os.close(fd)
    path.write_bytes(b"\ncd")  # the newline is the first byte of the file
    fd = os.open(path, os.O_RDONLY)
    try:
        assert _line_before(fd, 3, 3) == (1, b"cd")
    finally:
        os.close(fd)


def test_a_failed_roll_back_says_both_failures_and_how_to_repair(tmp_path, monkeypatch):
    import errno

    path = tmp_path / "rows.jsonl"
    path.write_bytes(encode_row(row(0)))
    size = path.stat().st_size

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    def broken(fd, length):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "write", full)
    monkeypatch.setattr(os, "ftruncate", broken)
    with pytest.raises(OSError) as err:
        append_json(path, {"event": "x"})
    assert str(err.value) == (
        f"appending a row to {path} failed ([Errno 28] No space left on device) and truncating back to offset "
        f"{size} failed too ([Errno 5] Input/output error); `pd-dflash run --resume` repairs the file"
    )
    assert isinstance(err.value.__cause__, OSError) and err.value.__cause__.errno == errno.ENOSPC
