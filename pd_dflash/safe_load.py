"""Reading untrusted text with bounds: UTF-8, YAML and JSON.

Every input file (a spec, a row file, a result matrix) goes through here, so a hostile or broken file becomes an
:class:`~pd_dflash.errors.InputError` naming the file (exit 2), never a traceback and never minutes of work:

- bytes that are not UTF-8 are named by offset;
- sizes are bounded: a JSON line (:data:`MAX_LINE_BYTES`) and a document read whole (:data:`MAX_DOCUMENT_BYTES`), so
  ``/dev/zero`` or a runaway file is named, never read until memory runs out;
- nesting is bounded (:data:`MAX_DEPTH` levels), so no parser or serializer recurses without limit;
- duplicate keys are refused in JSON as in YAML (both would silently keep the last one), named with the line;
- YAML is read with the safe loader (nothing is ever constructed from a tag), duplicate mapping keys are refused
  (YAML would silently keep the last one), and aliases may not expand the document beyond :data:`MAX_YAML_NODES`
  nodes (a "billion laughs" document is refused after counting, before anything is built from it);
- integer literals are bounded (:data:`MAX_INT_DIGITS`); values a schema cannot hold are the schema's to name.
"""

from __future__ import annotations

import json
import math
from json.decoder import JSONObject
from json.scanner import py_make_scanner
from typing import Any, BinaryIO

import yaml
from yaml.composer import ComposerError
from yaml.constructor import ConstructorError
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from pd_dflash.errors import InputError

#: Deepest nesting of lists and mappings accepted in any input (rows need about 5).
MAX_DEPTH = 64
#: Most nodes a YAML document may have once its aliases are expanded (a spec has a few hundred).
MAX_YAML_NODES = 100_000
#: Longest integer literal parsed (Python refuses to convert more than 4300 digits).
MAX_INT_DIGITS = 4000
#: Longest line of a JSON-lines file (a sweep row is about 10 KB; upstream's rows are smaller).
MAX_LINE_BYTES = 16 << 20
#: Largest JSON document read whole: an upstream row file or a result_matrix.json (the matrix of a 26,765-row,
#: 200 MB rows.jsonl is 252 MB, docs/metrics.md).
MAX_DOCUMENT_BYTES = 1 << 30


class MalformedText(InputError):
    """Bytes that are not UTF-8, or text that is not JSON: what a write cut short leaves (see rows.py)."""


def decode_utf8(raw: bytes, *, where: str) -> str:
    """``raw`` as text; a file that is not UTF-8 (a binary file) is named with the first bad byte."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        bad = raw[exc.start : exc.start + 1].hex()
        raise MalformedText(f"not UTF-8 text (byte 0x{bad} at offset {exc.start})", where=where) from None


def read_bounded(fh: BinaryIO, limit: int, *, where: str, what: str) -> bytes:
    """All of ``fh`` from its position, refused (InputError naming ``where``) beyond ``limit`` bytes."""
    data = fh.read(limit + 1)
    if len(data) > limit:
        raise InputError(
            f"{what} larger than {limit} bytes: refused (the bound on what is read whole)", where=where
        )
    return data


def read_line_bounded(fh: BinaryIO, *, where: str) -> bytes:
    """One line of a JSON-lines file (b"" at the end), refused beyond :data:`MAX_LINE_BYTES` bytes."""
    line = fh.readline(MAX_LINE_BYTES + 1)
    if len(line) > MAX_LINE_BYTES:
        raise InputError(
            f"line longer than {MAX_LINE_BYTES} bytes: not a row (the bound on one line)", where=where
        )
    return line


# -- JSON ------------------------------------------------------------------------------------------------


class _DuplicateKey(Exception):
    def __init__(self, key: str):
        self.key = key


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise _DuplicateKey(k)
            seen.add(k)
    return obj


def _line_of_duplicate(text: str, key: str) -> int | None:
    """The line of the object holding ``key`` twice: the text parsed again by the pure-Python scanner, which
    tells each object's offset (only on this error path; the C scanner tells none)."""
    decoder = json.JSONDecoder(parse_constant=lambda name: 0.0)

    def parse_object(s_and_end, strict, scan_once, object_hook, object_pairs_hook, memo=None):
        s, end = s_and_end
        pairs, after = JSONObject(s_and_end, strict, scan_once, None, list, memo)
        if sum(k == key for k, _ in pairs) > 1:
            raise _Located(s.count("\n", 0, end) + 1)
        return dict(pairs), after

    decoder.parse_object = parse_object
    decoder.scan_once = py_make_scanner(decoder)
    try:
        decoder.decode(text)
    except _Located as found:
        return found.line
    except (ValueError, RecursionError):
        return None
    return None


class _Located(Exception):
    def __init__(self, line: int):
        self.line = line


_CONSTANTS = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def load_json(
    text: str | bytes, *, where: str, constants: list[str] | None = None, name_line: bool = False
) -> Any:
    """``json.loads`` with the bounds above. NaN and Infinity are read (a schema names them where they
    matter); pass ``constants`` to learn which of them occurred (JSON proper has neither). ``name_line``:
    a syntax error names ``where:line`` (for a whole document; a JSON line's ``where`` has its line)."""

    def constant(name: str) -> float:
        if constants is not None:
            constants.append(name)
        return _CONSTANTS[name]

    try:
        value = json.loads(text, parse_constant=constant, object_pairs_hook=_no_duplicates)
    except _DuplicateKey as dup:
        at = where
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        if "\n" in text.rstrip("\r\n"):  # a whole document: name the line (a JSON line's where has it)
            line = _line_of_duplicate(text, dup.key)
            at = where if line is None else f"{where}:{line}"
        raise InputError(
            f"duplicate key {_short_key(dup.key)}: JSON would keep only the last (refused, as in a spec)",
            where=at,
        ) from None
    except RecursionError:
        raise InputError(f"nested deeper than {MAX_DEPTH} levels", where=where) from None
    except json.JSONDecodeError as exc:
        at = f"{where}:{exc.lineno}" if name_line else where
        raise MalformedText(f"invalid JSON: {exc.msg} (column {exc.colno})", where=at) from None
    except ValueError:  # an integer literal beyond Python's conversion limit (4300 digits)
        raise InputError("invalid JSON: an integer literal is too long to read", where=where) from None
    if value_depth(value) > MAX_DEPTH:
        raise InputError(f"nested deeper than {MAX_DEPTH} levels", where=where)
    return value


def value_depth(value: Any, limit: int = MAX_DEPTH) -> int:
    """How deeply ``value``'s lists and dicts nest (1 for a flat one), counted no further than ``limit + 1``."""
    if not isinstance(value, (dict, list)):
        return 0
    return _depth(value, 1, limit + 1)


def _depth(value: dict | list, depth: int, stop: int) -> int:
    if depth >= stop:
        return depth
    best = depth
    for item in value.values() if isinstance(value, dict) else value:
        if isinstance(item, (dict, list)):
            best = max(best, _depth(item, depth + 1, stop))
            if best >= stop:
                break
    return best


# -- YAML ------------------------------------------------------------------------------------------------


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader with a depth bound, an alias-expansion bound and duplicate keys refused."""

    _depth = 0

    def compose_node(self, parent: Node | None, index: Any) -> Node:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise ComposerError(None, None, f"nested deeper than {MAX_DEPTH} levels", mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def get_single_data(self) -> Any:
        node = self.get_single_node()
        if node is None:
            return None
        _check_expanded_size(node)
        return self.construct_document(node)

    def construct_mapping(self, node: Node, deep: bool = False) -> dict:
        if isinstance(node, MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.get(key)
                except TypeError:
                    continue  # an unhashable key: the base class names it
                if first is not None:
                    raise ConstructorError(
                        None,
                        None,
                        f"duplicate key {_short_key(key)} (first on line {first}); YAML would keep only the last",
                        key_node.start_mark,
                    )
                seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node: ScalarNode) -> int:
        if len(node.value) > MAX_INT_DIGITS:
            raise ConstructorError(
                None, None, f"integer literal of {len(node.value)} characters is too long", node.start_mark
            )
        return super().construct_yaml_int(node)


_BoundedLoader.add_constructor("tag:yaml.org,2002:int", _BoundedLoader.construct_yaml_int)


def _short_key(key: Any) -> str:
    text = repr(key)
    return text if len(text) <= 60 else text[:57] + "..."


def _children(node: Node) -> list[Node]:
    if isinstance(node, SequenceNode):
        return list(node.value)
    if isinstance(node, MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def _check_expanded_size(root: Node) -> None:
    """Count the nodes of the document with every alias expanded (memoised: linear in the composed graph) and
    refuse an alias that contains itself (``&a [*a]``: PyYAML would build a cyclic value)."""
    sizes: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[Node, bool]] = [(root, False)]
    while stack:
        node, finished = stack.pop()
        if finished:
            on_path.discard(id(node))
            total = 1 + sum(sizes[id(c)] for c in _children(node))
            if total > MAX_YAML_NODES:
                raise ComposerError(
                    None,
                    None,
                    f"the document expands to more than {MAX_YAML_NODES} nodes (aliases included)",
                    node.start_mark,
                )
            sizes[id(node)] = total
            continue
        if id(node) in sizes:
            continue
        if id(node) in on_path:
            raise ComposerError(None, None, "an alias refers to a node that contains it", node.start_mark)
        on_path.add(id(node))
        stack.append((node, True))
        stack.extend((c, False) for c in _children(node) if id(c) not in sizes)


def load_yaml(text: str, *, where: str) -> Any:
    """One YAML document through the bounded safe loader; errors name ``where:line``."""
    loader = _BoundedLoader(text)
    try:
        return loader.get_single_data()
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f"{where}:{mark.line + 1}" if mark is not None else where
        problem = getattr(exc, "problem", None) or str(exc)
        raise InputError(f"invalid YAML: {problem[:300]}", where=at) from None
    except RecursionError:
        raise InputError(f"invalid YAML: nested deeper than {MAX_DEPTH} levels", where=where) from None
    finally:
        loader.dispose()
