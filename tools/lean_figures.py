"""The code's figures: how much a reader must open to learn the algorithm, how much of it is
guarding, and what a training run loads that it does not use. Counted with Python's own
tokenizer and ast, so packing lines does not move them.

  core tokens       code tokens (not comments, docstrings, newlines, indentation) of CORE_FILES
  largest core file
  guard share       per core file (checks.py aside: a module of checks): tokens on
                    raise/assert/except lines, on if-blocks that only raise or warn, and on
                    warning calls, over the file's code tokens
  train closure     facenet modules that `import facenet.cli.train` loads in a fresh
                    interpreter, their code tokens, the wing modules among them, and what the
                    import costs (wall seconds, peak RSS)
  library tokens    the whole package: printed, not a target

Run from the repository root: ``python tools/lean_figures.py`` (exit 1 when a target is missed).
"""

import ast
import io
import subprocess
import sys
import tokenize
from pathlib import Path

# The core: the files a reader opens to learn the algorithm (README's map points here).
CORE_FILES = (
    "facenet/models/embedding.py",
    "facenet/models/tiny.py",
    "facenet/metric/distances.py",
    "facenet/metric/miners.py",
    "facenet/metric/losses.py",
    "facenet/metric/checks.py",
    "facenet/training/step.py",
    "facenet/training/engine.py",
    "facenet/training/loop.py",
    "facenet/evaluation/protocol.py",
)
# What the core files define between them (a name that moves out of them is reported).
CORE_NAMES = {
    "EmbeddingNet",
    "TinyCNN",
    "SemiHardNegativeMiner",
    "TripletMarginLoss",
    "get_distance",
    "check_index_triplets",
    "OnePassStep",
    "Trainer",
    "fit",
    "evaluate_verification",
}
TARGETS = {
    "core tokens": 13_500,
    "largest core file": 2_400,
    "worst core guard share %": 7.0,
    "train closure modules": 48,
    "train closure tokens": 56_000,
    "wing modules in train closure": 0,
}
_SKIP = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT}
_SKIP |= {tokenize.ENCODING, tokenize.ENDMARKER}
_SCOPES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
_CLOSURE = """
import resource, sys, time
start = time.perf_counter()
import facenet.cli.train
seconds = time.perf_counter() - start
print(seconds, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
print(*sorted(m for m in sys.modules if m.startswith("facenet")))
"""


def _docstring_lines(tree: ast.AST) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        body = node.body if isinstance(node, _SCOPES) else None
        first = body[0] if body else None
        value = getattr(first, "value", None) if isinstance(first, ast.Expr) else None
        if isinstance(value, ast.Constant) and isinstance(value.value, str):
            lines.update(range(first.lineno, first.end_lineno + 1))
    return lines


def _is_warning(node: ast.AST) -> bool:
    call = node.value if isinstance(node, ast.Expr) else None
    if not isinstance(call, ast.Call):
        return False
    name = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "")
    return name in ("warn", "warning")


def _guard_lines(tree: ast.AST) -> set[int]:
    """Lines of raise/assert/except, of if-blocks that only raise or warn, of warning calls."""
    lines = set()
    for node in ast.walk(tree):
        only_refuses = isinstance(node, ast.If) and not node.orelse
        only_refuses = only_refuses and all(
            isinstance(s, ast.Raise) or _is_warning(s) for s in node.body
        )
        if isinstance(node, (ast.Raise, ast.Assert, ast.ExceptHandler)) or only_refuses:
            lines.update(range(node.lineno, node.end_lineno + 1))
        elif _is_warning(node):
            lines.update(range(node.lineno, node.end_lineno + 1))
    return lines


def measure(path: Path) -> dict:
    """A file's code tokens, its guard tokens and the top-level names it defines."""
    source = path.read_text(encoding="utf-8")
    tree = ast.parse(source)
    docs, guards = _docstring_lines(tree), _guard_lines(tree)
    tokens = guard = 0
    for tok in tokenize.tokenize(io.BytesIO(source.encode()).readline):
        if tok.type in _SKIP or (tok.type == tokenize.STRING and tok.start[0] in docs):
            continue
        tokens += 1
        guard += tok.start[0] in guards
    defined = {n.name for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))}
    return {"tokens": tokens, "guard": guard, "defines": defined}


def train_closure(root: Path):
    """(import seconds, peak RSS in KiB, facenet modules) of ``import facenet.cli.train``."""
    venv = root / ".venv" / "bin" / "python"
    done = subprocess.run(
        [str(venv) if venv.exists() else sys.executable, "-c", _CLOSURE],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if done.returncode != 0:
        raise SystemExit(f"import facenet.cli.train failed: {done.stderr.strip()[-300:]}")
    timing, modules = done.stdout.splitlines()[-2:]
    seconds, rss = timing.split()
    return float(seconds), int(rss), modules.split()


def module_path(root: Path, name: str) -> Path:
    base = root.joinpath(*name.split("."))
    return base / "__init__.py" if (base / "__init__.py").exists() else base.with_suffix(".py")


def core_figures(root: Path) -> tuple[dict, dict]:
    """(values, notes) of the core's figures."""
    core = {name: measure(root / name) for name in CORE_FILES}
    largest = max(core, key=lambda name: core[name]["tokens"])
    shares = {
        name: 100 * f["guard"] / max(f["tokens"], 1)
        for name, f in core.items()
        if Path(name).stem != "checks"
    }
    worst = max(shares, key=shares.get)
    missing = CORE_NAMES - set().union(*(f["defines"] for f in core.values()))
    for name, f in core.items():
        print(f"      {f['tokens']:6,} tokens  guard {shares.get(name, 0):4.1f}%  {name}")
    values = {
        "core tokens": sum(f["tokens"] for f in core.values()),
        "largest core file": core[largest]["tokens"],
        "worst core guard share %": round(shares[worst], 1),
    }
    notes = {
        "core tokens": f"{len(core)} files; names not defined there: {sorted(missing) or 'none'}",
        "largest core file": largest,
        "worst core guard share %": worst,
    }
    return values, notes


def main() -> int:
    root = Path.cwd()
    if not (root / "facenet").is_dir():
        print("no facenet/ here: run from the repository root")
        return 2
    values, notes = core_figures(root)
    seconds, rss, modules = train_closure(root)
    wings = [m for m in modules if m.startswith("facenet.wings")]
    values["train closure modules"] = len(modules)
    values["train closure tokens"] = sum(measure(module_path(root, m))["tokens"] for m in modules)
    values["wing modules in train closure"] = len(wings)
    notes["wing modules in train closure"] = ", ".join(wings[:6]) or None
    notes["train closure modules"] = f"import {seconds:.2f} s, peak RSS {rss / 2**20:.2f} GiB"
    short = [key for key, limit in TARGETS.items() if values[key] > limit]
    for key, limit in TARGETS.items():
        where = f"  ({notes[key]})" if notes.get(key) else ""
        status = "FAIL" if key in short else "ok  "
        print(f"{status}  {key}: {values[key]:,} (target <= {limit:,}){where}")
    library = sum(measure(path)["tokens"] for path in sorted((root / "facenet").rglob("*.py")))
    print(f"info  library tokens: {library:,} (a figure, not a target)")
    return 1 if short else 0


if __name__ == "__main__":
    sys.exit(main())
