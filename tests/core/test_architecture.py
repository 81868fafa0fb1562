"""The package's shape: no import cycle, imports that run one way, and the size limits (docs/architecture.md).

Everything is read statically with ``ast`` (nothing is imported), so the checks cover every import: at module
level, inside functions, and under ``if TYPE_CHECKING:``.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "pd_dflash"
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 80
#: Argument tables are exempt from the function limit (one add_argument per line reads better than helpers).
ARGUMENT_TABLES = frozenset({"cli.py:build_parser"})


@dataclass(frozen=True)
class Module:
    name: str  # dotted, e.g. pd_dflash.report.gates
    path: Path
    tree: ast.Module

    @property
    def rel(self) -> str:
        return self.path.relative_to(PACKAGE).as_posix()

    @property
    def is_package(self) -> bool:
        return self.path.name == "__init__.py"


def _modules() -> dict[str, Module]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        name = ".".join(parts)
        found[name] = Module(name, path, ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
    return found


MODULES = _modules()


def _resolve(module: Module, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.name.split(".")
    base = base if module.is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def imports_of(module: Module) -> set[str]:
    """Every pd_dflash module this module imports, anywhere in its body."""
    out: set[str] = set()
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, node)
            # ``from pkg import sub`` imports the submodule when there is one, else a name of ``pkg``.
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        out.update(n for n in names if n == "pd_dflash" or n.startswith("pd_dflash."))
    return {n for n in out if n in MODULES and n != module.name} | (
        {module.name} if module.name in out else set()
    )


def external_imports_of(module: Module) -> set[str]:
    """Top-level names of every third-party package this module imports."""
    out = set()
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module.split(".")[0])
    return out


GRAPH = {name: imports_of(m) for name, m in MODULES.items()}


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative (the graph is small, but recursion limits are not a test's business)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                found.append(sorted(component))
    return found


def _layer(name: str) -> str:
    if name.startswith("pd_dflash.engine"):
        return "engine"
    if name.startswith("pd_dflash.sweep"):
        return "sweep"
    if name in ("pd_dflash.cli", "pd_dflash.__main__"):
        return "cli"
    return "core"


# -- (a) no import cycle ---------------------------------------------------------------------------------------


def test_the_graph_sees_every_kind_of_import():
    # A function-level import (cli's lazy handlers) and a TYPE_CHECKING import are both edges.
    assert "pd_dflash.report.validate" in GRAPH["pd_dflash.cli"]
    assert "pd_dflash.engine.interface" in GRAPH["pd_dflash.engine.registry"]
    assert "pd_dflash.spec" in GRAPH["pd_dflash.engine.registry"]


def test_cycle_detection_finds_a_cycle():
    assert _strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c"], ["d"]]


def test_no_import_cycle_inside_the_package():
    cycles = [c for c in _strongly_connected(GRAPH) if len(c) > 1 or c[0] in GRAPH[c[0]]]
    assert not cycles, f"import cycles: {cycles}"


# -- (b) layers ----------------------------------------------------------------------------------------------


def test_core_imports_no_engine_and_no_sweep_code():
    bad = {
        name: sorted(n for n in deps if _layer(n) in ("engine", "sweep"))
        for name, deps in GRAPH.items()
        if _layer(name) == "core"
    }
    assert not {k: v for k, v in bad.items() if v}


def test_engine_imports_no_sweep_code():
    bad = {
        name: sorted(n for n in deps if _layer(n) == "sweep")
        for name, deps in GRAPH.items()
        if _layer(name) == "engine"
    }
    assert not {k: v for k, v in bad.items() if v}


def test_torch_only_under_engine_and_ray_only_under_sweep():
    for name, module in MODULES.items():
        external = external_imports_of(module)
        if _layer(name) != "engine":
            assert not external & {"torch", "transformers"}, name
        if _layer(name) != "sweep":
            assert "ray" not in external, name


# -- (c) sizes -----------------------------------------------------------------------------------------------


def _functions(module: Module):
    """(qualified name, lines) of every function and method, nested ones included."""

    def walk(node: ast.AST, prefix: str):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                yield name, child.end_lineno - child.lineno + 1
                yield from walk(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}{child.name}.")
            else:
                yield from walk(child, prefix)

    yield from walk(module.tree, "")


def oversized_modules() -> set[str]:
    return {
        m.rel
        for m in MODULES.values()
        if len(m.path.read_text(encoding="utf-8").splitlines()) > MAX_MODULE_LINES
    }


def oversized_functions() -> set[str]:
    return {
        f"{m.rel}:{name}"
        for m in MODULES.values()
        for name, lines in _functions(m)
        if lines > MAX_FUNCTION_LINES
    } - ARGUMENT_TABLES


def test_no_module_over_the_line_limit():
    over = oversized_modules()
    assert over == set(), f"modules over {MAX_MODULE_LINES} lines"


def test_no_function_over_the_line_limit():
    over = oversized_functions()
    assert over == set(), f"functions over {MAX_FUNCTION_LINES} lines"


def test_the_argument_table_exemption_names_a_real_function():
    names = {f"{m.rel}:{n}" for m in MODULES.values() for n, _ in _functions(m)}
    assert names >= ARGUMENT_TABLES


def _mapped_modules(doc: str) -> set[str]:
    """Module paths named in docs/architecture.md's module map (``pkg/`` (`a`, `b`) expands to pkg/a.py ...)."""
    table = doc.split("## Module map", 1)[1].split("\n\n", 2)[2]
    named: set[str] = set()
    for line in table.splitlines():
        cells = line.split(" | ")
        if len(cells) < 3 or not line.startswith("| "):
            continue
        cell = cells[1]
        package = re.match(r"`([\w/]+/)` \(([^)]*)\)", cell)
        if package:
            named |= {f"{package.group(1)}{n}.py" for n in re.findall(r"`(\w+)`", package.group(2))}
        else:
            named |= {n for n in re.findall(r"`([\w/]+\.py)`", cell)}
    return named


def test_the_module_map_matches_the_tree():
    doc = (PACKAGE.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    on_disk = {
        str(p.relative_to(PACKAGE))
        for p in PACKAGE.rglob("*.py")
        if p.name != "__init__.py" and "__pycache__" not in p.parts
    }
    named = _mapped_modules(doc)
    assert on_disk - named == set(), "modules missing from docs/architecture.md's module map"
    assert named - on_disk == set(), "docs/architecture.md names modules that do not exist"


# -- (d) the rooms of engine/reference --------------------------------------------------------------------------

REFERENCE = "pd_dflash.engine.reference"
#: engine/reference's rooms, lowest first (docs/architecture.md, "The reference engine's rooms"): a room imports at
#: run time only from itself and the rooms before it. A folder is a room; top-level modules are placed by name.
REFERENCE_ROOMS: tuple[tuple[str, frozenset[str]], ...] = (
    (
        "leaves",
        frozenset({"", "host_sync", "options", "requirements", "seams", "prompts", "positions", "artifacts"}),
    ),
    ("families", frozenset({"families"})),
    ("offload", frozenset({"offload"})),
    ("checkpoints", frozenset({"checkpoints"})),
    ("decoding", frozenset({"decoding"})),
    ("dflash", frozenset({"dflash"})),
    ("presets", frozenset({"presets"})),
    ("cell", frozenset({"models", "drafters", "cell", "trace", "spec_check", "engine"})),
)


def _type_checking_block(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
    )


def runtime_imports_of(module: Module) -> set[str]:
    """``imports_of`` without the imports under ``if TYPE_CHECKING:`` (annotations only, never run)."""
    typing_only = [n for n in ast.walk(module.tree) if _type_checking_block(n)]
    tree = ast.Module(
        body=[
            stmt
            for stmt in ast.walk(module.tree)
            if isinstance(stmt, (ast.Import, ast.ImportFrom))
            and not any(stmt in ast.walk(block) for block in typing_only)
        ],
        type_ignores=[],
    )
    return imports_of(Module(module.name, module.path, tree))


def reference_room(name: str) -> int | None:
    """The rank of a module's room in ``REFERENCE_ROOMS`` (None outside engine/reference)."""
    if name != REFERENCE and not name.startswith(f"{REFERENCE}."):
        return None
    first = name[len(REFERENCE) + 1 :].split(".")[0]
    ranks = [i for i, (_, members) in enumerate(REFERENCE_ROOMS) if first in members]
    assert ranks, f"{name}: its room is not placed in REFERENCE_ROOMS (docs/architecture.md)"
    return ranks[0]


def test_the_room_check_reads_runtime_imports_only():
    seams = MODULES[f"{REFERENCE}.seams"]
    assert f"{REFERENCE}.decoding.target" in imports_of(seams)  # its annotations' types ...
    assert f"{REFERENCE}.decoding.target" not in runtime_imports_of(seams)  # ... are never imported
    assert f"{REFERENCE}.host_sync" in runtime_imports_of(MODULES[f"{REFERENCE}.decoding.target"])
    # A function-level import runs: it counts.
    assert f"{REFERENCE}.artifacts" in runtime_imports_of(MODULES[f"{REFERENCE}.checkpoints.tiny"])


def test_every_reference_module_has_a_room():
    for name in MODULES:
        reference_room(name)


def test_no_reference_room_imports_a_later_one_at_run_time():
    against = sorted(
        f"{name} -> {dep}"
        for name, module in MODULES.items()
        if (rank := reference_room(name)) is not None
        for dep in runtime_imports_of(module)
        if (dep_rank := reference_room(dep)) is not None and dep_rank > rank
    )
    assert not against, "imports against the rooms' order (docs/architecture.md)"


def test_the_documented_room_order_is_the_tested_one():
    doc = (PACKAGE.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    line = next(ln.strip() for ln in doc.splitlines() if ln.strip().startswith("Rooms, lowest first:"))
    assert [r.strip(" `.") for r in line.split(":", 1)[1].split("→")] == [name for name, _ in REFERENCE_ROOMS]


def test_where_to_change_what_names_files_that_exist():
    """docs/architecture.md's "Where to change what" reads right from ``ls``: every path it names exists (a
    path is relative to the repository, ``pd_dflash/``, ``pd_dflash/engine/`` or ``pd_dflash/engine/reference/``;
    ``pkg/`` (`a`, `b`) names pkg/a.py and pkg/b.py)."""
    repo = PACKAGE.parent
    doc = (repo / "docs" / "architecture.md").read_text(encoding="utf-8")
    table = doc.split("## Where to change what", 1)[1].split("\n## ", 1)[0]
    bases = (repo, PACKAGE, PACKAGE / "engine", PACKAGE / "engine" / "reference")
    named: set[str] = set()
    for line in table.splitlines()[2:]:
        for package, members in re.findall(r"`([\w/]+/)` \(([^)]*)\)", line):
            named |= {f"{package}{m}.py" for m in re.findall(r"`(\w+)`", members)}
        named |= set(re.findall(r"`([\w/.]+\.(?:py|md))", line))
    assert len(named) > 20
    missing = sorted(n for n in named if not any((base / n).exists() for base in bases))
    assert not missing, "paths in docs/architecture.md's 'Where to change what' that do not exist"
