"""rows.jsonl survives faults (issue 12, items 1 and 2): an append is all-or-nothing, a complete last row
without its newline is a row, a torn tail is repaired and reported, temp files never outlive a failed write,
and every file rows.py creates is 0640 or stricter whatever the umask."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from pd_dflash.rows import (
    FILE_MODE,
    UnsafeAppend,
    append_row,
    encode_row,
    read_rows,
    repair_tail,
    write_atomic,
)
from tests.core.helpers import ours_row

REPO = Path(__file__).resolve().parents[2]


def test_a_write_cut_by_a_file_size_limit_is_rolled_back_and_the_next_append_is_clean(tmp_path):
    """A real partial write: RLIMIT_FSIZE lets the kernel write part of the row, then refuses (EFBIG), as a
    full disk does. The file must be back at its last good offset before anything else is written, and once
    space is back the next row lands on a line of its own."""
    path = tmp_path / "rows.jsonl"
    append_row(path, ours_row(0))
    good = path.stat().st_size
    code = f"""
import os, resource, signal
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
from pd_dflash.rows import append_row
from pd_dflash.schema import parse_row
from tests.core.helpers import upstream
path = {str(path)!r}
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (os.path.getsize(path) + 100, hard))
try:
    append_row(path, parse_row(upstream("OURS", repeat=1), where="t"))
    print("appended")
except OSError as exc:
    print("refused", exc.errno, os.path.getsize(path))
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
append_row(path, parse_row(upstream("OURS", repeat=2), where="t"))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr
    refused, errno_, size = done.stdout.split()
    assert refused == "refused" and int(errno_) == 27  # EFBIG
    assert int(size) == good  # rolled back: no partial line was left behind
    rows, torn = read_rows(path, tolerate_torn_tail=True)
    assert torn is None and [r.repeat for r in rows] == [0, 2]
    assert path.read_bytes().count(b"\n") == 2


def test_a_complete_last_row_without_newline_is_kept_and_the_next_append_starts_a_line(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(encode_row(ours_row(0)) + encode_row(ours_row(1)).rstrip(b"\n"))
    rows, torn = read_rows(path, tolerate_torn_tail=True)
    assert torn is None and [r.repeat for r in rows] == [0, 1]
    append_row(path, ours_row(2))
    rows, torn = read_rows(path, tolerate_torn_tail=True)
    assert torn is None and [r.repeat for r in rows] == [0, 1, 2]
    assert path.read_bytes().endswith(b"\n") and path.read_bytes().count(b"\n") == 3


def test_repair_keeps_a_complete_last_row_and_adds_its_newline(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(encode_row(ours_row(0)) + encode_row(ours_row(1)).rstrip(b"\n"))
    repaired = repair_tail(path)
    assert repaired is not None and repaired.kind == "newline" and "newline" in repaired.describe()
    assert not (tmp_path / "rows.jsonl.torn").exists()
    assert [r.repeat for r in read_rows(path)[0]] == [0, 1]
    assert repair_tail(path) is None  # nothing left to repair


def test_repair_moves_a_torn_tail_aside_and_says_so(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(encode_row(ours_row(0)) + encode_row(ours_row(1))[:50])
    repaired = repair_tail(path)
    assert repaired is not None and repaired.kind == "torn" and repaired.size == 50
    assert str(tmp_path / "rows.jsonl.torn") in repaired.describe()
    assert (tmp_path / "rows.jsonl.torn").read_bytes() == encode_row(ours_row(1))[:50] + b"\n"
    assert path.read_bytes() == encode_row(ours_row(0))


def test_an_append_onto_a_torn_tail_is_refused_and_changes_nothing(tmp_path):
    path = tmp_path / "rows.jsonl"
    before = encode_row(ours_row(0)) + b'{"model": "openai/gpt'
    path.write_bytes(before)
    with pytest.raises(UnsafeAppend, match="incomplete line"):
        append_row(path, ours_row(1))
    assert path.read_bytes() == before


def test_a_failed_atomic_write_leaves_no_temp_file(tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("a directory is in the way")
    with pytest.raises(OSError):
        write_atomic(tmp_path / "taken", "text")  # the rename fails
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]

    def half_then_fail(fh):
        fh.write("{")
        raise RuntimeError("the writer failed")

    with pytest.raises(RuntimeError):
        write_atomic(tmp_path / "m.json", half_then_fail)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]
    write_atomic(tmp_path / "m.json", lambda fh: fh.write("{}\n"))
    assert (tmp_path / "m.json").read_text() == "{}\n"


def test_files_are_created_0640_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        append_row(tmp_path / "rows.jsonl", ours_row(0))
        write_atomic(tmp_path / "result_matrix.json", "{}\n")
        write_atomic(tmp_path / "plot.png", b"\x89PNG")
        (tmp_path / "torn.jsonl").write_bytes(b'{"a": ')
        repair_tail(tmp_path / "torn.jsonl")
    finally:
        os.umask(old)
    assert FILE_MODE == 0o640
    for name in ("rows.jsonl", "result_matrix.json", "plot.png", "torn.jsonl.torn"):
        mode = stat.S_IMODE((tmp_path / name).stat().st_mode)
        assert mode == 0o640, (name, oct(mode))
    old = os.umask(0o077)
    try:
        write_atomic(tmp_path / "strict.json", "{}")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "strict.json").stat().st_mode) == 0o600  # a stricter umask narrows it


def test_stored_lines_are_compact_json_of_the_row(tmp_path):
    path = tmp_path / "rows.jsonl"
    append_row(path, ours_row(0))
    line = path.read_bytes()
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert json.loads(line) == ours_row(0).to_json_dict()


def test_a_callable_writes_utf8_whatever_the_locale(tmp_path):
    """The text a writer function gets is UTF-8 with "\\n" line ends even where the locale's encoding is
    ASCII (LC_ALL=C with Python's UTF-8 mode and locale coercion off): the locale never picks the encoding."""
    target = tmp_path / "m.txt"
    code = f"""
import locale
from pd_dflash.rows import write_atomic
print(locale.getpreferredencoding(False))
write_atomic({str(target)!r}, lambda fh: fh.write("caf\\u00e9 \\u03c4\\n"))
"""
    env = {**os.environ, "LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[0].lower() in ("ansi_x3.4-1968", "ascii", "us-ascii")  # the locale is ASCII
    assert target.read_bytes() == b"caf\xc3\xa9 \xcf\x84\n"


def test_the_temp_file_is_a_hidden_sibling_named_by_pid_and_8_hex_digits(tmp_path):
    """``.<name>.tmp-<pid>-<8 hex digits>``: what the store's stale-file patterns match, and a suffix short
    enough that a long target name still fits the filesystem's name limit."""
    seen: list[str] = []

    def look(fh):
        seen.extend(p.name for p in tmp_path.iterdir())
        fh.write("{}\n")

    write_atomic(tmp_path / "m.json", look)
    (name,) = seen
    prefix = f".m.json.tmp-{os.getpid()}-"
    assert name.startswith(prefix)
    suffix = name[len(prefix) :]
    assert len(suffix) == 8 and set(suffix) <= set("0123456789abcdef"), name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.json"]


def test_a_temp_file_removed_by_someone_else_does_not_hide_the_failure(tmp_path):
    """The writer's own error is what a failed write raises, even when its temp file is already gone (another
    process cleaned the directory): removing the temp file tolerates its absence."""

    def vanish_then_fail(fh):
        fh.write("{")
        for p in tmp_path.glob(".*.tmp*"):
            p.unlink()
        raise RuntimeError("the writer failed")

    with pytest.raises(RuntimeError, match="the writer failed"):
        write_atomic(tmp_path / "m.json", vanish_then_fail)
    assert list(tmp_path.iterdir()) == []
