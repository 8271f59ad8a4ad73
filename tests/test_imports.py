"""The package's import graph: no cycle (imports inside functions count), the library layer
imports neither the configuration nor the training layer, and the wings (optional features)
are imported by no core or run-layer module: importing the training command or the protocol
loads none of them."""

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "facenet"
# The small shared pieces at the top of the package: modules, not folders.
SHARED = {
    "errors",
    "files",
    "sizes",
    "distributed",
    "memory",
    "checkpoint",
    "config",
    "registry",
}
# What each folder (or shared module) may import, by the first name under facenet. A folder
# may import the shared pieces listed here and the folders below it; the library folders
# import neither the configuration nor the training layer.
ALLOWED = {
    "errors": set(),
    "registry": set(),
    "files": {"errors"},
    "sizes": set(),
    "distributed": {"errors"},
    "memory": set(),
    "checkpoint": {"errors", "files"},
    # the eval section is checked by building its VerifySettings (facenet.evaluation.presets)
    "config": {"errors", "files", "sizes", "evaluation"},
    "metric": {"errors", "registry"},
    "models": {"errors", "checkpoint", "sizes", "registry"},
    "data": {"errors", "files", "sizes"},
    "evaluation": {"errors", "files", "sizes", "distributed", "metric", "data"},
    # optional features: below the commands, above the library; nothing but a command or
    # another wing imports them (a run loads one through facenet.registry)
    "wings": {
        "memory",
        "errors",
        "files",
        "sizes",
        "checkpoint",
        "metric",
        "models",
        "data",
        "evaluation",
    },
    "training": SHARED | {"metric", "models", "data", "evaluation"},
    "cli": SHARED | {"metric", "models", "data", "evaluation", "wings", "training"},
}
# Inside facenet.training imports go one way: a module imports none after it.
TRAINING_ORDER = [
    "facenet.training.step",
    "facenet.training.engine",
    "facenet.training.state",
    "facenet.training.build",
    "facenet.training.loop",
    "facenet.training.run",
]


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
    assert "facenet.training.step" in graph and graph["facenet.training.engine"]  # parser sees it
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_find_cycle_sees_a_cycle_through_a_function_level_import(tmp_path):
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from facenet.training.run import fit\n", encoding="utf-8")
    known = {"facenet.training.run"}
    assert imported_modules("facenet.x", module, known) == {"facenet.training.run"}


def _part(module: str) -> str:
    """The first name under facenet: a folder or a shared module."""
    return module.split(".")[1]


def test_every_part_of_the_package_has_a_layer():
    parts = {_part(name) for name in import_graph() if name != "facenet"}
    assert parts == set(ALLOWED), f"unlisted: {parts - set(ALLOWED)}; gone: {set(ALLOWED) - parts}"


def test_each_part_imports_only_the_layers_below_it():
    graph = import_graph()
    for name, targets in graph.items():
        if name == "facenet":
            continue
        part = _part(name)
        outside = {t for t in targets if t != "facenet" and _part(t) != part}
        bad = {t for t in outside if _part(t) not in ALLOWED[part]}
        assert not bad, f"{name} imports {sorted(bad)}"


def test_nothing_outside_training_imports_it_and_the_library_not_the_config():
    graph = import_graph()
    for name, targets in graph.items():
        if name == "facenet" or _part(name) in {"training", "cli"}:
            continue
        assert not {t for t in targets if t.startswith("facenet.training")}, name
        assert "facenet.config" not in targets or _part(name) == "config", name


def test_the_training_layer_imports_one_way():
    graph = import_graph()
    for lower, name in enumerate(TRAINING_ORDER):
        later = set(TRAINING_ORDER[lower + 1 :])
        assert not graph[name] & later, f"{name} imports {graph[name] & later}"


def _loaded_by(statement: str) -> list[str]:
    """The facenet modules a fresh interpreter has loaded after ``statement``."""
    code = f"import sys; {statement}; print(*sorted(m for m in sys.modules if 'facenet' in m))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return done.stdout.split()


def test_training_and_the_protocol_load_no_wing():
    for statement in ("import facenet.cli.train", "import facenet.evaluation.protocol"):
        loaded = _loaded_by(statement)
        assert statement.split()[1] in loaded
        assert not [m for m in loaded if m.startswith("facenet.wings")], statement


def test_a_run_that_names_a_wing_loads_it():
    # the demo's data and the publishers' networks: loaded when asked for, not before
    loaded = _loaded_by(
        "from facenet.models.embedding import EmbeddingNet; "
        "EmbeddingNet('mobilefacenet', 8, input_size=(112, 96))"
    )
    assert "facenet.wings.publishers.mobilefacenet" in loaded
    assert "facenet.wings.demo.synthetic" not in loaded
