"""Helpers shared by tests in more than one directory (per-directory ones live in that directory's helpers.py;
docs/testing.md lists them all)."""

from __future__ import annotations

import re


def exactly(text: str) -> str:
    """A pattern matching ``text`` and nothing around it (pytest.raises(match=...) searches)."""
    return f"^{re.escape(text)}$"
