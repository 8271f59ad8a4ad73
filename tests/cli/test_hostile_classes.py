"""Every console command against the hostile classes, one row per command and case: a command
added to pyproject.toml's [project.scripts] fails the test until it has a row here.

The class held here: an output that is one of the command's inputs, or lies inside a folder it
reads, also through a symbolic link on the output's path or a hard link to the input. Each case
must end in exit 2 with one ``error:`` line, before any work, with every byte under the test's
folder as it was (``facenet.cli.guards``).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

ROOT = Path(__file__).resolve().parents[2]


def console_scripts() -> dict[str, str]:
    """``[project.scripts]`` of pyproject.toml: command name -> ``module:function``."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


def _file(path: Path, content: bytes = b"the user's own") -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    return str(path)


def _faces(root: Path) -> str:
    """Two identity folders of one image each (never decoded: the refusal comes first)."""
    for identity in ("anna", "bob"):
        _file(root / identity / f"{identity}_0001.png")
    return str(root)


def _config(path: Path) -> str:
    return _file(path, b"train:\n  epochs: 1\n")


# name -> (command, argv built in a folder); each argv names one of its inputs as an output.
# The refusal names the input (facenet.cli.guards), or says the output exists where a command
# replaces nothing at all.
Case = Callable[[Path], list[str]]
CASES: dict[str, tuple[str, Case]] = {
    "train: --out is --config": (
        "facenet-train",
        lambda d: ["--config", _config(d / "c.yaml"), "--out", str(d / "c.yaml")],
    ),
    "evaluate: --out holds --distances as metrics.json": (
        "facenet-evaluate",
        lambda d: ["--distances", _file(d / "metrics.json"), "--out", str(d), "--overwrite"],
    ),
    "evaluate: --out inside --retrieval": (
        "facenet-evaluate",
        lambda d: [
            *("--checkpoint", _file(d / "m.pt"), "--retrieval", _faces(d / "faces")),
            *("--out", str(d / "faces" / "anna")),
        ],
    ),
    "embed: --out is --checkpoint": (
        "facenet-embed",
        lambda d: [
            *("--checkpoint", _file(d / "m.pt"), "--images", _faces(d / "faces")),
            *("--out", str(d / "m.pt"), "--overwrite"),
        ],
    ),
    "embed: --out inside --images": (
        "facenet-embed",
        lambda d: [
            *("--checkpoint", _file(d / "m.pt"), "--images", _faces(d / "faces")),
            *("--out", str(d / "faces" / "anna" / "e.npz")),
        ],
    ),
    "embed: --out a hard link to --checkpoint": (
        "facenet-embed",
        lambda d: [
            *("--checkpoint", _file(d / "m.pt"), "--images", _faces(d / "faces")),
            *("--out", _hard_link(d / "m.pt", d / "e.npz"), "--overwrite"),
        ],
    ),
    "identify: --out holds --gallery as matches.csv": (
        "facenet-identify",
        lambda d: [
            *("--gallery", _file(d / "matches.csv"), "--probes", _file(d / "p.npz")),
            *("--threshold", "1", "--out", str(d), "--overwrite"),
        ],
    ),
    "export: --out is --checkpoint": (
        "facenet-export",
        lambda d: [
            *("--checkpoint", _file(d / "x.pt"), "--format", "weights"),
            *("--out", str(d / "x.pt"), "--overwrite"),
        ],
    ),
    "export: --out through a link to --checkpoint's folder": (
        "facenet-export",
        lambda d: [
            *("--checkpoint", _file(d / "run" / "x.pt"), "--format", "weights"),
            *("--out", str(_link(d / "run", d / "alias") / "x.pt"), "--overwrite"),
        ],
    ),
    "align: DST inside SRC": (
        "facenet-align",
        lambda d: [_faces(d / "faces"), str(d / "faces" / "crops"), "--no-progress"],
    ),
    "make-pairs: --out an image of ROOT": (
        "facenet-make-pairs",
        lambda d: [_faces(d / "faces"), "--out", str(d / "faces" / "anna" / "anna_0001.png")],
    ),
    "make-synthetic: --preview is --config": (
        "facenet-make-synthetic",
        lambda d: [
            str(d / "set"),
            "--config",
            _config(d / "c.yaml"),
            "--preview",
            str(d / "c.yaml"),
        ],
    ),
    "convert: DST is SRC": (
        "facenet-convert",
        lambda d: [_file(d / "x.pb"), str(d / "x.pb"), "--overwrite"],
    ),
    "make-templates: DST/loose_crop a link to SRC": (
        "facenet-make-templates",
        lambda d: [
            _faces(d / "faces"),
            str(_link(d / "faces", d / "set" / "loose_crop").parent),
            *("--overwrite", "--no-progress"),
        ],
    ),
    "audit: --out inside --train": (
        "facenet-audit",
        lambda d: [
            *("--checkpoint", _file(d / "x.pt"), "--train", _faces(d / "faces")),
            *("--pairs", _file(d / "pairs.txt"), "--out", str(d / "faces" / "audit")),
        ],
    ),
    "make-rec: DST is SRC": (
        "facenet-make-rec",
        lambda d: [_faces(d / "faces"), str(d / "faces")],
    ),
}


def _link(target: Path, link: Path) -> Path:
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target, target_is_directory=True)
    return link


def _hard_link(target: Path, link: Path) -> str:
    os.link(target, link)
    return str(link)


def _tree(root: Path) -> dict:
    """Every path under ``root`` (links not followed) and its bytes or link target."""
    return {
        p: os.readlink(p) if p.is_symlink() else p.read_bytes() if p.is_file() else None
        for p in sorted(root.rglob("*"))
    }


def _main(script: str) -> Callable[[list[str]], int]:
    module, function = console_scripts()[script].split(":")
    return getattr(importlib.import_module(module), function)


def test_every_command_has_a_row():
    missing = set(console_scripts()) - {script for script, _ in CASES.values()}
    assert not missing, f"commands without a hostile-class row: {sorted(missing)}"


@pytest.mark.parametrize("case", CASES)
def test_an_output_naming_an_input_is_refused_before_any_work(case, tmp_path, capsys):
    script, build = CASES[case]
    argv = build(tmp_path)
    before = _tree(tmp_path)
    assert _main(script)(argv) == 2, case
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.splitlines()) == 1, (case, err)
    says = "exists" if script == "facenet-make-pairs" else "the input"
    assert says in err, (case, err)  # refused for this reason, not for an unreadable input
    assert _tree(tmp_path) == before, case  # nothing written, replaced or linked
