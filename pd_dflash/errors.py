"""Errors that carry the field path or file position they are about, so the CLI can name it and exit 2."""

from __future__ import annotations

import datetime
from typing import Any

from pydantic import ValidationError

#: The longest message an InputError prints (an error quotes a bounded excerpt of its input, never all of it).
MAX_MESSAGE = 2000


class InputError(Exception):
    """A bad input (spec, row file, CLI argument). The message names the field path or the file and line."""

    exit_code = 2

    def __init__(self, message: str, *, where: str | None = None):
        if len(message) > MAX_MESSAGE:
            message = message[:MAX_MESSAGE] + f"... ({len(message) - MAX_MESSAGE} more characters)"
        if where is not None and len(where) > MAX_MESSAGE // 4:
            where = where[: MAX_MESSAGE // 4] + "..."
        self.where = where
        self.message = message
        super().__init__(f"{where}: {message}" if where else message)


def format_validation_error(exc: ValidationError, *, prefix: str = "") -> str:
    """One line per pydantic error: ``field.path: message (got value)``, with list indices kept."""
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "__root__")
        path = ".".join(p for p in (prefix, loc) if p)
        msg = err.get("msg", "invalid")
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, ") :]
        got = err.get("input", _MISSING)
        shown = "" if got is _MISSING or err.get("type") == "missing" else f" (got {excerpt(got)})"
        lines.append(f"{path or '<root>'}: {msg}{shown}{_how_to_fix(err, got, loc)}")
    return "; ".join(lines)


def _how_to_fix(err: Any, got: Any, loc: str) -> str:
    """The fix, where it is known: YAML reads an unquoted ``2025-08-05`` as a date and ``yes``/``on`` as a
    boolean, and a number is no text in YAML or JSON, so a field that wants text gets something else; quoting
    it keeps it text."""
    if err.get("type") != "string_type":
        return ""
    key = loc.rsplit(".", 1)[-1] or "the value"
    if isinstance(got, (datetime.date, datetime.time)):  # datetime.datetime is a date
        return f'; YAML read an unquoted date: quote it, e.g. {key}: "{got.isoformat()}"'
    if isinstance(got, bool):
        return "; quote it to keep it text (YAML reads an unquoted yes/no/on/off/true/false as a boolean)"
    if isinstance(got, (int, float)):
        return "; quote it to keep it text (a number, unquoted)"
    return ""


_MISSING = object()


def excerpt(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters: an error message quotes at most this much of an input.

    Long strings and containers are cut before they are rendered, so quoting a huge input costs no more than
    quoting a short one; an integer too long to print is described by its size.
    """
    if isinstance(value, (str, bytes)) and len(value) > limit:
        value = value[:limit]
    elif isinstance(value, (list, tuple)) and len(value) > limit:
        value = type(value)(value[:limit])
    elif isinstance(value, dict) and len(value) > limit:
        value = dict(list(value.items())[:limit])
    try:
        text = repr(value)
    except (ValueError, RecursionError):  # an int over Python's digit limit; a nesting too deep to render
        text = f"<{type(value).__name__} too large to print>"
    return text if len(text) <= limit else text[: limit - 3] + "..."
