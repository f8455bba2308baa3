"""The package's import graph: no circle of modules, no import from a lower floor to a higher one.

Every import in ra_lens counts, the lazy ones inside functions included; only imports under
`if TYPE_CHECKING:` are left out (type hints, never run). docs/architecture.md draws the floors.
"""

from __future__ import annotations

import ast
from pathlib import Path

from helpers import REPO_ROOT

PACKAGE = REPO_ROOT / "ra_lens"

#: Lowest first. A module sits on the floor of its longest listed prefix; "ra_lens" itself (the
#: package's __init__, which gathers the public names) is on the top floor.
FLOORS: list[tuple[str, list[str]]] = [
    (
        "ground: pure functions, files, views",
        [
            "ra_lens._typing",
            "ra_lens._version",
            "ra_lens.math",
            "ra_lens.progress",
            "ra_lens.files",
            "ra_lens.timing",
            "ra_lens.checks",
            "ra_lens.record",
            "ra_lens.attribution.softmax",
            "ra_lens.nnsight._trace",
            "ra_lens.nnsight._server",
            "ra_lens.tasks._task",
            "ra_lens.viz",
        ],
    ),
    (
        "the model: contract, state, tokens, metrics, pairs, loading",
        [
            "ra_lens.contract",
            "ra_lens.weights",
            "ra_lens.attention",
            "ra_lens.state",
            "ra_lens.liveness",
            "ra_lens.capture",
            "ra_lens.types",
            "ra_lens.metrics",
            "ra_lens.pairs",
            "ra_lens.nnsight.adapter",
            "ra_lens.embedded_wheels",
            "ra_lens.embedded_cache",
            "ra_lens.embedded",
            "ra_lens.smollm2",
            "ra_lens.gemma3",
            "ra_lens.models",
            "ra_lens.toy_models",
            "ra_lens.tasks.prompts",
            "ra_lens.tasks.ioi",
        ],
    ),
    (
        "the engine: RA, its result, patching hooks, accuracy",
        [
            "ra_lens.core",
            "ra_lens.layerwise",
            "ra_lens.result",
            "ra_lens.nnsight",
            "ra_lens.patching",
            "ra_lens.tasks",
        ],
    ),
    (
        "the families: rankings, attribution, circuits, dynamics",
        ["ra_lens.ranking", "ra_lens.attribution", "ra_lens.circuits", "ra_lens.dynamics"],
    ),
    (
        "the top: experiments, the CLI, the package's public names",
        ["ra_lens.experiments", "ra_lens.cli", "ra_lens"],
    ),
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def _resolve(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


class _Imports(ast.NodeVisitor):
    """The ra_lens modules one module imports, TYPE_CHECKING blocks aside."""

    def __init__(self, package: str) -> None:
        self.package = package
        self.found: set[str] = set()

    def visit_If(self, node: ast.If) -> None:
        test = node.test
        if (
            getattr(test, "id", None) == "TYPE_CHECKING"
            or getattr(test, "attr", None) == "TYPE_CHECKING"
        ):
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name.split(".")[0] == "ra_lens":
                self._add(_resolve(alias.name))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            base = self.package.split(".")[: len(self.package.split(".")) - node.level + 1]
            module = ".".join(base + ([node.module] if node.module else []))
        else:
            module = node.module or ""
        if module.split(".")[0] != "ra_lens":
            return
        for alias in node.names:
            full = f"{module}.{alias.name}"
            self._add(full if full in MODULES else _resolve(module))

    def _add(self, name: str | None) -> None:
        if name is not None:
            self.found.add(name)


def import_graph() -> dict[str, set[str]]:
    graph = {}
    for name, path in MODULES.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        visitor = _Imports(package)
        visitor.visit(ast.parse(path.read_text()))
        graph[name] = visitor.found - {name}
    return graph


def floor_of(module: str) -> int:
    best: tuple[int, int] | None = None  # (prefix length, floor)
    for floor, (_, prefixes) in enumerate(FLOORS):
        for prefix in prefixes:
            exact_only = prefix == "ra_lens"
            if module == prefix or (not exact_only and module.startswith(prefix + ".")):
                if best is None or len(prefix) > best[0]:
                    best = (len(prefix), floor)
    assert best is not None, f"{module} is on no floor: add it to FLOORS and docs/architecture.md"
    return best[1]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for child in sorted(graph[node]):
            if child not in index:
                visit(child)
                low[node] = min(low[node], low[child])
            elif child in on_stack:
                low[node] = min(low[node], index[child])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_graph_sees_lazy_imports_and_skips_type_checking_ones():
    graph = import_graph()
    assert "ra_lens.nnsight.route" in graph["ra_lens.core"]  # imported inside reversed_attention
    assert "ra_lens.result" not in graph["ra_lens.viz.maps"]  # under TYPE_CHECKING only
    # the circuit views name the circuits and RA for type hints only; their callers import them
    assert graph["ra_lens.viz.circuit_page"] == {"ra_lens._version", "ra_lens.files"}
    assert graph["ra_lens.viz.circuit_draw"] == {"ra_lens.viz._base"}


def test_no_module_imports_itself_back_through_others():
    assert cycles(import_graph()) == []


def test_no_import_runs_from_a_lower_floor_to_a_higher_one():
    upward = [
        f"{module} (floor {floor_of(module)}) -> {target} (floor {floor_of(target)})"
        for module, targets in import_graph().items()
        for target in sorted(targets)
        if floor_of(target) > floor_of(module)
    ]
    assert upward == []


def test_tests_import_their_builders_one_way():
    """`from helpers import ...` everywhere: `tests.helpers` would be a second module object,
    with its own copies of the builders' caches."""
    twice = [
        str(path.relative_to(REPO_ROOT))
        for path in (REPO_ROOT / "tests").rglob("*.py")
        if path != Path(__file__)
        if "from tests.helpers import" in path.read_text()
        or "from tests import helpers" in path.read_text()
    ]
    assert twice == []


#: A file a reader can hold in mind, and a function whose code fits on a screen or two.
MAX_FILE_LINES, MAX_FUNCTION_LINES = 600, 80


def code_lines(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """The lines of a function's signature and code, its docstring left out (a docstring with
    Args, Returns and an example is documentation, not length to read through)."""
    body = function.body
    first = body[0]
    docstring = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str)  # fmt: skip
    assert function.end_lineno is not None and first.end_lineno is not None
    if not docstring:
        return function.end_lineno - function.lineno + 1
    skipped = (body[1].lineno if len(body) > 1 else first.end_lineno + 1) - first.lineno
    return function.end_lineno - function.lineno + 1 - skipped


def test_no_file_over_600_lines_and_no_function_over_80_lines_of_code():
    long_files, long_functions = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        name = str(path.relative_to(REPO_ROOT))
        if len(text.splitlines()) > MAX_FILE_LINES:
            long_files.append(f"{name}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                if code_lines(node) > MAX_FUNCTION_LINES:
                    long_functions.append(f"{name}::{node.name}: {code_lines(node)} lines")
    assert long_files == [] and long_functions == []


def test_code_lines_leave_the_docstring_out():
    (function,) = ast.parse('def f(x):\n    """Doc.\n\n    More.\n    """\n    y = x\n    return y\n').body  # fmt: skip
    (bare,) = ast.parse("def g(x):\n    return x\n").body
    assert isinstance(function, ast.FunctionDef) and isinstance(bare, ast.FunctionDef)
    assert (code_lines(function), code_lines(bare)) == (3, 2)


def test_no_underscore_name_is_imported_from_another_module():
    """A name with a leading underscore stays in its module: what siblings share has a plain
    name (in a private module where only the package uses it). Private modules themselves
    (`from ra_lens.circuits import _edges`) may be imported within their package."""
    found = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ra_lens"):
                for alias in node.names:
                    private = alias.name.startswith("_") and not alias.name.startswith("__")
                    if private and f"{node.module}.{alias.name}" not in MODULES:
                        found.append(f"{name}: from {node.module} import {alias.name}")
    assert found == []
