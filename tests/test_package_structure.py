"""The package's import graph: no cycle among `qwen35_accel` modules, and the product
(everything outside `qwen35_accel/testing/`) imports nothing of `testing/`.

The graph is read from the sources (no module is imported, no process started). An edge
A -> B means running A can import B:
- every `import` and `from … import` statement, at module level or inside a function: a
  deferred import still makes the two modules depend on each other, and a cycle hidden in a
  function is a cycle (ARCHITECTURE.md: "No import cycles, also inside a package");
- except those under `if TYPE_CHECKING:` (never run);
- a string constant that is exactly the name of one of our modules counts as an import
  (`importlib.import_module("qwen35_accel.…")` is an import written differently);
- `from P import x` imports P (its `__init__`) unless P is a package the importing module
  lives in (already imported before it) and every `x` is a submodule of P; it imports P.x
  where that is a module; `import a.b.c` and `from a.b.c import …` import the packages a
  and a.b as well, unless the importer lives in them.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "qwen35_accel"

Edge = tuple[str, int]  # (imported module, line of the import in the importer)


def _modules(package: Path) -> dict[str, tuple[Path, bool]]:
    """{dotted module name: (source file, is a package's __init__)} for every .py under `package`."""
    modules = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return modules


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the nodes under `if TYPE_CHECKING:` blocks."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                skipped.update(id(n) for n in ast.walk(child))
    return skipped


def import_graph(package: Path) -> dict[str, dict[str, int]]:
    """{module: {module it may import: line of the first such import}} for `package`'s modules."""
    modules = _modules(package)
    graph: dict[str, dict[str, int]] = {}
    for name, (path, is_package) in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        skipped = _type_checking_nodes(tree)
        ancestors = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        if is_package:
            ancestors.add(name)
        edges: dict[str, int] = {}

        def add(target: str, line: int, *, with_packages: bool = True) -> None:
            parts = target.split(".")
            prefixes = [".".join(parts[:i]) for i in range(1, len(parts))] if with_packages else []
            for module in (*prefixes, target):
                if module in modules and module != name and (module == target or module not in ancestors):
                    edges.setdefault(module, line)

        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.Import):
                for alias in node.names:
                    add(alias.name, node.lineno)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".") if is_package else name.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                submodules = [f"{source}.{alias.name}" for alias in node.names]
                for module in submodules:
                    if module in modules:
                        add(module, node.lineno, with_packages=False)
                if source not in ancestors or not all(m in modules for m in submodules):
                    add(source, node.lineno)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in modules:
                add(node.value, node.lineno)
        graph[name] = edges
    return graph


def import_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan), each as
    [a, b, …, a] following the edges."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    cycles = []
    for component in components:
        members = set(component)
        start = min(component)
        # A shortest way back to `start` inside the component (breadth first).
        previous: dict[str, str] = {}
        frontier = [start]
        while frontier and start not in previous:
            following = []
            for v in frontier:
                for w in sorted(graph[v]):
                    if w in members and w not in previous:
                        previous[w] = v
                        following.append(w)
            frontier = following
        path = [start]
        while path[-1] != start or len(path) == 1:
            path.append(previous[path[-1]])
        cycles.append(path[::-1])
    return cycles


def _describe(cycle: list[str], graph: dict[str, dict[str, int]]) -> str:
    return " -> ".join(
        f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])
    ) + f" -> {cycle[-1]}"


def test_no_import_cycle_among_the_package_modules():
    graph = import_graph(PACKAGE)
    # The reading finds the imports it must (module level, deferred, relative, and the registry's wrappers).
    assert "qwen35_accel.integrations.accelerate.preparation" in graph["qwen35_accel.integrations.accelerate.accelerate_points"]
    assert "qwen35_accel.integrations.accelerate.accelerate_points" in graph["qwen35_accel.integrations.patches"]
    assert "qwen35_accel.integrations.activation" in graph["qwen35_accel.integrations.accelerate.preparation"]  # in a function
    assert "qwen35_accel.parallelization" in graph["qwen35_accel"]  # a string for importlib
    cycles = import_cycles(graph)
    assert not cycles, "import cycles (module (line of its import) -> …):\n" + "\n".join(_describe(c, graph) for c in cycles)


def test_the_product_imports_nothing_of_testing():
    graph = import_graph(PACKAGE)
    testing = "qwen35_accel.testing"
    offenders = [
        f"{module} imports {target} (line {line})"
        for module, edges in sorted(graph.items())
        if not (module == testing or module.startswith(testing + "."))
        for target, line in edges.items()
        if target == testing or target.startswith(testing + ".")
    ]
    assert not offenders, "\n".join(offenders)
    assert any(t.startswith("qwen35_accel.model.") for t in graph["qwen35_accel.testing.tiny"])  # the edges are read


def test_the_check_finds_a_cycle_through_a_deferred_import_and_names_it(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("from .wrappers import wrap\n")
    (package / "registry.py").write_text("from .sub import wrappers\nPOINTS = [wrappers.wrap]\n")
    (package / "sub" / "wrappers.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..other import x\n\n"
        "def wrap():\n    from ..registry import POINTS\n    return POINTS\n"
    )
    (package / "other.py").write_text("from .sub.wrappers import wrap\n")
    graph = import_graph(package)
    assert graph["pkg.other"] == {"pkg.sub": 1, "pkg.sub.wrappers": 1}
    assert "pkg.other" not in graph["pkg.sub.wrappers"]  # TYPE_CHECKING imports are not run
    cycles = import_cycles(graph)
    assert cycles == [["pkg.registry", "pkg.sub.wrappers", "pkg.registry"]]
    assert _describe(cycles[0], graph) == "pkg.registry (line 1) -> pkg.sub.wrappers (line 6) -> pkg.registry"


MODULE_MAX_LINES = 450  # a module holds one idea; past this it holds several (split it by concern)


def test_no_module_of_the_package_is_over_450_lines():
    sizes = {path.relative_to(PACKAGE.parent): len(path.read_text().splitlines()) for path in sorted(PACKAGE.rglob("*.py"))}
    assert len(sizes) > 20 and max(sizes.values()) > 100  # the files are read
    over = [f"{path}: {lines} lines" for path, lines in sizes.items() if lines > MODULE_MAX_LINES]
    assert not over, f"modules over {MODULE_MAX_LINES} lines (split them by concern):\n" + "\n".join(over)


def test_no_function_is_longer_than_80_lines_and_apply_is_its_pipeline():
    """The package's functions stay readable (docstrings included), and `PARALLELIZER.apply` is the
    list of its steps (`pipeline`), each a method of the parallelizer (issue 59)."""
    import inspect

    from qwen35_accel import PARALLELIZER

    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 80:
                long.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert not long, long
    assert len(inspect.getsource(type(PARALLELIZER).apply).splitlines()) < 60
    assert all(callable(getattr(PARALLELIZER, step)) for step in PARALLELIZER.pipeline)


def test_module_file_names_are_distinct():
    """A file name says which module it is (no three layout.py): only `testing/`'s re-export facades
    share a name with the module they re-export."""
    from collections import Counter

    names = Counter(path.name for path in PACKAGE.rglob("*.py") if path.name != "__init__.py")
    facades = {"tiny.py", "local_world.py"}  # testing/tiny.py and testing/local_world.py re-export model/ and the root's
    assert not [name for name, count in names.items() if count > 1 and name not in facades], names.most_common(5)
