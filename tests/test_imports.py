"""The package's import graph: no cycle (imports inside functions count), and the library
layer imports neither the configuration nor the training layer."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "facenet"
TRAINING_LAYER = {
    "facenet.config",
    "facenet.step",
    "facenet.trainer",
    "facenet.resume",
    "facenet.builders",
    "facenet.run",
    "facenet.run_logger",
    "facenet.optim",
}
LIBRARY_LAYER = (
    "facenet.distances",
    "facenet.miners",
    "facenet.losses",
    "facenet.models",
    "facenet.backbones",
    "facenet.evaluation",
    "facenet.data",
    "facenet.memory",
    "facenet.distributed",
    "facenet.checkpoint",
    "facenet.embed",
    "facenet.errors",
    "facenet.files",
    "facenet.presets",
    "facenet.align",
)


def module_names() -> dict[str, Path]:
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _is_type_checking_block(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """Package modules ``name`` imports anywhere (functions included; TYPE_CHECKING not)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skipped = {id(n) for b in ast.walk(tree) if _is_type_checking_block(b) for n in ast.walk(b)}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            candidates = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for candidate in candidates:
            while candidate and candidate not in known:
                candidate = candidate.rpartition(".")[0]
            # A package's __init__ importing its own submodules is not a dependency cycle.
            if candidate and candidate != name and not candidate.startswith(name + "."):
                found.add(candidate)
    return found


def import_graph() -> dict[str, set[str]]:
    names = module_names()
    return {name: imported_modules(name, path, set(names)) for name, path in names.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a list of modules (first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return path[path.index(target) :] + [target]
            if target not in state:
                cycle = visit(target)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            cycle = visit(start)
            if cycle:
                return cycle
    return None


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert "facenet.step" in graph and graph["facenet.trainer"]  # the parser sees the package
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_find_cycle_sees_a_cycle_through_a_function_level_import(tmp_path):
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from facenet.run import fit\n", encoding="utf-8")
    assert imported_modules("facenet.x", module, {"facenet.run"}) == {"facenet.run"}


@pytest.mark.parametrize("library", LIBRARY_LAYER)
def test_the_library_layer_imports_no_training_layer(library):
    graph = import_graph()
    modules = [name for name in graph if name == library or name.startswith(library + ".")]
    assert modules
    for name in modules:
        assert not graph[name] & TRAINING_LAYER, f"{name} imports {graph[name] & TRAINING_LAYER}"


def test_the_training_layer_imports_one_way():
    graph = import_graph()
    order = ["facenet.step", "facenet.trainer", "facenet.resume", "facenet.builders", "facenet.run"]
    for lower, name in enumerate(order):
        later = set(order[lower + 1 :])
        assert not graph[name] & later, f"{name} imports {graph[name] & later}"


@pytest.mark.parametrize(
    "module",
    ["facenet.trained", "facenet.identify", "facenet.export", "facenet.data.insightface_bin"],
)
def test_the_modules_for_trained_models_are_library_layer(module):
    graph = import_graph()
    assert module in graph
    assert not graph[module] & TRAINING_LAYER, f"{module} imports {graph[module] & TRAINING_LAYER}"
