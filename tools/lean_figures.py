"""Size figures of the code, by Python's own tokenizer and ast (packing lines does not move them).

code tokens: tokens that are neither comments, docstrings, newlines nor indentation; prose lines:
docstring and comment lines; the longest function (lines, its docstring excluded); the widest
signature (parameters, self/cls excluded); tuples/sets/lists of image-file extensions.
Run from the repository root: ``python tools/lean_figures.py``.
"""

import ast
import io
import re
import sys
import tokenize
from pathlib import Path

LIMITS = {
    "library code tokens": 72_000,
    "benchmarks code tokens": 18_000,
    "library prose lines": 3_500,
    "README lines": 300,
    "longest function (lines)": 45,
    "widest signature (parameters)": 8,
    "image-extension lists": 1,
}
_SKIP = {
    tokenize.COMMENT,
    tokenize.NL,
    tokenize.NEWLINE,
    tokenize.INDENT,
    tokenize.DEDENT,
    tokenize.ENCODING,
    tokenize.ENDMARKER,
}
_EXTENSION = re.compile(r"\.?(jpe?g|png|bmp|gif|webp|tiff?|pgm|ppm)", re.I)


def _docstring(node) -> ast.Expr | None:
    body = getattr(node, "body", None)
    first = body[0] if body else None
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
        return first if isinstance(first.value.value, str) else None
    return None


def _is_extension_list(node) -> bool:
    names = [e.value for e in getattr(node, "elts", ()) if isinstance(e, ast.Constant)]
    names = [v for v in names if isinstance(v, str)]
    return len(names) >= 3 and sum(bool(_EXTENSION.fullmatch(v)) for v in names) >= 3


def measure_file(path: Path) -> dict:
    """One file's figures; longest/widest as (value, 'path:line name')."""
    source = path.read_text(encoding="utf-8")
    tree = ast.parse(source)
    scopes = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    docs = [d for n in ast.walk(tree) if isinstance(n, scopes) and (d := _docstring(n))]
    doc_lines = {line for d in docs for line in range(d.lineno, d.end_lineno + 1)}
    tokens, comments = 0, set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments.add(tok.start[0])
        elif tok.type not in _SKIP and not (
            tok.type == tokenize.STRING and tok.start[0] in doc_lines
        ):
            tokens += 1
    longest, widest = (0, ""), (0, "")
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            where = f"{path}:{node.lineno} {node.name}"
            doc = (
                node.body[0]
                if isinstance(node.body[0], ast.Expr)
                and isinstance(node.body[0].value, ast.Constant)
                else None
            )
            lines = node.end_lineno - node.lineno + 1
            lines -= doc.end_lineno - doc.lineno + 1 if doc else 0
            a = node.args
            params = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs]
            width = sum(p not in ("self", "cls") for p in params) + bool(a.vararg) + bool(a.kwarg)
            longest, widest = max(longest, (lines, where)), max(widest, (width, where))
    sequences = (n for n in ast.walk(tree) if isinstance(n, (ast.Tuple, ast.Set, ast.List)))
    lists = sum(map(_is_extension_list, sequences))
    return {
        "tokens": tokens,
        "prose": len(doc_lines | comments),
        "longest": longest,
        "widest": widest,
        "lists": lists,
    }


def measure_tree(root: str) -> dict:
    """The figures of every .py file under ``root``, summed (longest/widest: the maximum)."""
    total = {"tokens": 0, "prose": 0, "longest": (0, ""), "widest": (0, ""), "lists": 0}
    for path in sorted(Path(root).rglob("*.py")):
        one = measure_file(path)
        for key in ("tokens", "prose", "lists"):
            total[key] += one[key]
        for key in ("longest", "widest"):
            total[key] = max(total[key], one[key])
    return total


def main() -> int:
    lib, bench = measure_tree("facenet"), measure_tree("benchmarks")
    figures = {
        "library code tokens": (lib["tokens"], ""),
        "benchmarks code tokens": (bench["tokens"], ""),
        "library prose lines": (lib["prose"], ""),
        "README lines": (len(Path("README.md").read_text().splitlines()), ""),
        "longest function (lines)": lib["longest"],
        "widest signature (parameters)": lib["widest"],
        "image-extension lists": (lib["lists"], ""),
    }
    failed = [name for name, (value, _) in figures.items() if value > LIMITS[name]]
    for name, (value, where) in figures.items():
        status = "FAIL" if name in failed else "ok  "
        print(f"{status} {name}: {value} (limit {LIMITS[name]}) {where}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
