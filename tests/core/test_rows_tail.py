"""Where a tail repair happens, to the byte; reading a missing file; compact event lines (rows.py)."""

from __future__ import annotations

import json
import os

import pytest

from pd_dflash.errors import InputError
from pd_dflash.rows import _line_before, append_json, encode_row, read_rows, repair_tail
from pd_dflash.sweep.resume import current_rows_of
from tests.core.helpers import ours_row


def test_a_newline_repair_happens_at_the_end_of_the_file(tmp_path):
    path = tmp_path / "rows.jsonl"
    body = encode_row(ours_row(0)) + encode_row(ours_row(1)).rstrip(b"\n")
    path.write_bytes(body)
    repaired = repair_tail(path)
    assert (repaired.kind, repaired.offset, repaired.size, repaired.aside) == ("newline", len(body), 0, None)
    assert path.read_bytes() == body + b"\n"


def test_a_torn_repair_cuts_at_the_start_of_the_torn_line(tmp_path):
    path = tmp_path / "rows.jsonl"
    first = encode_row(ours_row(0))
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
    (tmp_path / "rows.jsonl").write_bytes(encode_row(ours_row(0)) + b'{"model": "m')
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
        path.write_bytes(encode_row(ours_row(0)) + last)
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
    path.write_bytes(encode_row(ours_row(0)))
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


# -- reading: places in messages, whole-JSON files, torn lines -------------------------------------------------


def test_a_torn_last_line_keeps_its_text_without_the_newline(tmp_path):
    from pd_dflash.rows import read_rows

    path = tmp_path / "rows.jsonl"
    first = encode_row(ours_row(0))
    path.write_bytes(first + b'{"model": "m\xff  \n\n')  # cut short, with a byte that is not UTF-8
    rows, torn = read_rows(path, tolerate_torn_tail=True)
    assert [r.repeat for r in rows] == [0]
    assert torn.offset == len(first) and torn.text == '{"model": "m\ufffd  '
    with pytest.raises(InputError) as err:
        read_rows(path)
    message = str(err.value)
    assert message.startswith(f"{path}:2: not UTF-8 text (byte 0xff at offset 12)")
    assert message.endswith(" (torn last line: a write cut by a crash; `pd-dflash run --resume` repairs it)")
    path.write_bytes(first + b'{"model": "XX\n')  # only the newline is cut from the kept text
    assert read_rows(path, tolerate_torn_tail=True)[1].text == '{"model": "XX'


def test_a_bad_line_in_the_middle_is_named_by_its_line(tmp_path):
    from pd_dflash.rows import read_rows

    path = tmp_path / "rows.jsonl"
    path.write_bytes(encode_row(ours_row(0)) + b"\xfe\n" + encode_row(ours_row(1)))
    with pytest.raises(InputError) as err:
        read_rows(path, tolerate_torn_tail=True)
    assert str(err.value) == f"{path}:2: not UTF-8 text (byte 0xfe at offset 0)"


def test_whole_json_files_indented_listed_or_single_with_their_places(tmp_path):
    import json as _json

    from pd_dflash.rows import iter_rows

    listed = tmp_path / "rows.json"
    listed.write_text(
        "\n  " + _json.dumps([ours_row(0).to_json_dict(), ours_row(1).to_json_dict()], indent=2)
    )
    got = list(iter_rows(listed))
    assert [(r.repeat, s.path, s.label, s.offset) for r, s in got] == [
        (0, listed, f"{listed}[0]", None),
        (1, listed, f"{listed}[1]", None),
    ]
    single = tmp_path / "row.json"
    single.write_text(_json.dumps(ours_row(2).to_json_dict(), indent=2))
    ((only, source),) = list(iter_rows(single))
    assert only.repeat == 2 and (source.path, source.label) == (single, str(single))
    bad = tmp_path / "bad.json"
    bad.write_text(
        _json.dumps(
            [ours_row(0).to_json_dict(), {**ours_row(1).to_json_dict(), "ttft_seconds": -1}], indent=1
        )
    )
    with pytest.raises(InputError) as err:
        list(iter_rows(bad))
    assert str(err.value).startswith(f"{bad}[1]: ")
    bad_single = tmp_path / "bad_single.json"
    bad_single.write_text(_json.dumps({**ours_row(0).to_json_dict(), "ttft_seconds": -1}, indent=1))
    with pytest.raises(InputError) as err:
        list(iter_rows(bad_single))
    assert str(err.value).startswith(f"{bad_single}: ") and "ttft_seconds" in str(err.value)


def test_nan_in_a_free_form_field_is_refused_naming_the_file(tmp_path):
    from pd_dflash.rows import iter_rows

    text = encode_row(ours_row(0)).decode().rstrip("\n")
    whole = tmp_path / "rows.json"
    whole.write_text("[" + text[:-1] + ', "engine": {"x": NaN}}]')
    with pytest.raises(InputError) as err:
        list(iter_rows(whole))
    assert str(err.value) == f"{whole}: NaN in a free-form field: JSON has no such number"
    lines = tmp_path / "rows.jsonl"
    lines.write_text(text[:-1] + ', "engine": {"x": Infinity}}\n')
    with pytest.raises(InputError) as err:
        list(iter_rows(lines))
    assert str(err.value) == f"{lines}:1: Infinity in a free-form field: JSON has no such number"


def test_a_file_starting_with_whitespace_or_a_foreign_byte(tmp_path):
    from pd_dflash.rows import iter_rows

    spaced = tmp_path / "rows.json"
    spaced.write_text("  \n\t" + json.dumps([ours_row(0).to_json_dict()], indent=2))
    assert [r.repeat for r, _ in iter_rows(spaced)] == [0]
    foreign = tmp_path / "rows.bin"
    foreign.write_bytes(b"\xff\xfe[]")
    with pytest.raises(InputError) as err:
        list(iter_rows(foreign))
    assert str(err.value).startswith(f"{foreign}:1: not UTF-8 text (byte 0xff at offset 0)")


def test_an_unreadable_whole_json_file_says_why(tmp_path, monkeypatch):
    import errno

    from pd_dflash import rows
    from pd_dflash.rows import iter_rows

    path = tmp_path / "rows.json"
    path.write_text("[]")

    def failing(*args, **kwargs):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(rows, "read_bounded", failing)
    with pytest.raises(InputError) as err:
        list(iter_rows(path))
    assert str(err.value) == f"{path}: cannot read rows: Input/output error"
    lines = tmp_path / "rows.jsonl"
    lines.write_text("{}\n")
    monkeypatch.setattr(rows, "read_line_bounded", failing)  # a JSON-lines file is read line by line
    with pytest.raises(InputError) as err:
        list(iter_rows(lines))
    assert str(err.value) == f"{lines}: cannot read rows: Input/output error"


def test_a_stored_line_is_read_back_as_it_is(tmp_path):
    from pd_dflash.rows import RowSource, read_line_at

    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'{"a": 1}  \r\n\xff\n')
    assert read_line_at(RowSource(path, "rows.jsonl:1", 0)) == '{"a": 1}  '
    ends_in_x = tmp_path / "x.jsonl"
    ends_in_x.write_bytes(b'{"a": 1}\n{"b": "X"}XX\r\n')  # only the line end is cut, never other characters
    assert read_line_at(RowSource(ends_in_x, "x.jsonl:2", 9)) == '{"b": "X"}XX'
    with pytest.raises(InputError) as err:
        read_line_at(RowSource(path, "rows.jsonl:2", 12))
    assert str(err.value) == "rows.jsonl:2: not UTF-8 text (byte 0xff at offset 0)"
    with pytest.raises(ValueError, match=r"^rows\.json\[0\] has no offset \(not a JSON lines row\)$"):
        read_line_at(RowSource(path, "rows.json[0]"))


def test_an_append_onto_a_torn_line_names_the_file_and_the_offset(tmp_path):
    from pd_dflash.rows import UnsafeAppend, append_row

    path = tmp_path / "rows.jsonl"
    first = encode_row(ours_row(0))
    path.write_bytes(first + b'{"mod')
    with pytest.raises(UnsafeAppend) as err:
        append_row(path, ours_row(1))
    assert str(err.value) == (
        f"{path} ends with an incomplete line at offset {len(first)}: run `pd-dflash run --resume` to repair it"
    )


def test_a_whole_json_file_nested_too_deep_is_named(tmp_path):
    from pd_dflash.rows import iter_rows

    path = tmp_path / "rows.json"
    path.write_text("[" * 100 + "]" * 100)
    with pytest.raises(InputError) as err:
        list(iter_rows(path))
    assert str(err.value) == f"{path}: nested deeper than 64 levels"


def test_only_the_first_4096_bytes_decide_whether_a_file_is_one_json_document(tmp_path):
    """A bounded peek (a large JSON-lines file is never read whole to learn its kind): a row object after
    4095 blank bytes is a whole-JSON file; after 4096 the peek sees only blanks and the file is read as JSON
    lines (the same row, named by its line and offset)."""
    from pd_dflash.rows import iter_rows

    text = encode_row(ours_row(3))
    near = tmp_path / "near.json"
    near.write_bytes(b"\n" * 4095 + text)
    ((got, source),) = list(iter_rows(near))
    assert got.repeat == 3 and (source.label, source.offset) == (str(near), None)
    far = tmp_path / "far.json"
    far.write_bytes(b"\n" * 4096 + text)
    ((got, source),) = list(iter_rows(far))
    assert got.repeat == 3 and (source.label, source.offset) == (f"{far}:4097", 4096)
