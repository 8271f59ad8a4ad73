"""Every console command against the hostile classes, one row per command and case: a command
added to pyproject.toml's [project.scripts] fails the test until it has a row in each table
that applies to every command.

The classes held here (docs/reliability.md lists where each is enforced):

- an output that is one of the command's inputs, or lies inside a folder it reads, also through
  a symbolic link on the output's path or a hard link to the input (``CASES``, every command);
- a FIFO, folder or device where a file is expected, as an input or an output (``NOT_FILES``,
  every command): refused without blocking;
- a symbolic link among the folders inside an output folder (``LINKS``, the commands that write
  into sub-folders);
- a declared count past what the file holds (``COUNTS``, the readers).

Each case must end in exit 2 with one ``error:`` line, before any work, with every byte under
the test's folder as it was.
"""

from __future__ import annotations

import importlib
import os
import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from facenet.data.pairs import read_pairs
from facenet.data.recordio import encode_record, image_payload, open_recordio
from facenet.errors import DataError

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
    "audit: --cache inside --train": (
        "facenet-audit",
        lambda d: [
            *("--checkpoint", _file(d / "x.pt"), "--train", _faces(d / "faces")),
            *("--pairs", _file(d / "pairs.txt"), "--out", str(d / "audit")),
            *("--cache", str(d / "faces" / "anna")),
        ],
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


@pytest.mark.parametrize("table", ["CASES", "NOT_FILES"])
def test_every_command_has_a_row(table):
    rows = globals()[table].values()
    missing = set(console_scripts()) - {script for script, _ in rows}
    assert not missing, f"commands without a {table} row: {sorted(missing)}"


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


# ------------------------------------------------------------------ a FIFO, folder or device
def _fifo(path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(path)
    return str(path)


def _folder_of(path: str) -> str:
    return str(Path(path).parent)


# name -> (command, argv) naming a FIFO, folder or device where the command expects a file.
NOT_FILES: dict[str, tuple[str, Case]] = {
    "train: --config a FIFO": ("facenet-train", lambda d: ["--config", _fifo(d / "c.yaml")]),
    "train: --config a device": ("facenet-train", lambda d: ["--config", os.devnull]),
    "evaluate: --distances a FIFO": (
        "facenet-evaluate",
        lambda d: ["--distances", _fifo(d / "d.csv"), "--out", str(d / "out")],
    ),
    "evaluate: --out/metrics.json a FIFO": (
        "facenet-evaluate",
        lambda d: [
            *("--distances", _file(d / "d.csv")),
            *("--out", _folder_of(_fifo(d / "out" / "metrics.json")), "--overwrite"),
        ],
    ),
    "embed: --checkpoint a FIFO": (
        "facenet-embed",
        lambda d: [
            *("--checkpoint", _fifo(d / "m.pt"), "--images", _faces(d / "faces")),
            *("--out", str(d / "e.npz")),
        ],
    ),
    "embed: --checkpoint a folder": (
        "facenet-embed",
        lambda d: [
            *("--checkpoint", _faces(d / "m.pt"), "--images", _faces(d / "faces")),
            *("--out", str(d / "e.npz")),
        ],
    ),
    "identify: --gallery a FIFO": (
        "facenet-identify",
        lambda d: [
            *("--gallery", _fifo(d / "g.npz"), "--probes", _file(d / "p.npz")),
            *("--threshold", "1", "--out", str(d / "out")),
        ],
    ),
    "export: --checkpoint a device": (
        "facenet-export",
        lambda d: ["--checkpoint", os.devnull, "--format", "weights", "--out", str(d / "w.pt")],
    ),
    "export: --out a FIFO": (
        "facenet-export",
        lambda d: [
            *("--checkpoint", _file(d / "x.pt"), "--format", "weights"),
            *("--out", _fifo(d / "w.pt"), "--overwrite"),
        ],
    ),
    "align: --report a FIFO": (
        "facenet-align",
        lambda d: [
            *(_faces(d / "faces"), str(d / "crops")),
            *("--report", _fifo(d / "r.tsv"), "--no-progress"),
        ],
    ),
    "make-pairs: --out a FIFO": (
        "facenet-make-pairs",
        lambda d: [_faces(d / "faces"), "--out", _fifo(d / "pairs.txt")],
    ),
    "make-synthetic: --config a FIFO": (
        "facenet-make-synthetic",
        lambda d: [str(d / "set"), "--config", _fifo(d / "c.yaml")],
    ),
    "convert: SRC a FIFO": (
        "facenet-convert",
        lambda d: [_fifo(d / "x.pb"), str(d / "w.pt")],
    ),
    "make-templates: DST/make_templates_report.tsv a FIFO": (
        "facenet-make-templates",
        lambda d: [
            *(_faces(d / "faces"), _folder_of(_fifo(d / "set" / "make_templates_report.tsv"))),
            *("--overwrite", "--no-progress"),
        ],
    ),
    "audit: --checkpoint a FIFO": (
        "facenet-audit",
        lambda d: [
            *("--checkpoint", _fifo(d / "x.pt"), "--train", _faces(d / "faces")),
            *("--pairs", _file(d / "pairs.txt"), "--out", str(d / "audit")),
        ],
    ),
    "make-rec: DST/train.rec a FIFO": (
        "facenet-make-rec",
        lambda d: [_faces(d / "faces"), _folder_of(_fifo(d / "rec" / "train.rec")), "--overwrite"],
    ),
    "make-synthetic: --preview a FIFO": (
        "facenet-make-synthetic",
        lambda d: [str(d / "set"), "--preview", _fifo(d / "p.png")],
    ),
}


@pytest.fixture
def no_hang():
    """Fail, instead of hanging, where a FIFO is opened for reading and waits for a writer."""

    def hung(*_):
        raise TimeoutError("blocked on a FIFO")

    before = signal.signal(signal.SIGALRM, hung)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, before)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
@pytest.mark.parametrize("case", NOT_FILES)
def test_a_fifo_folder_or_device_for_a_file_is_one_line(case, tmp_path, capsys, no_hang):
    script, build = NOT_FILES[case]
    argv = build(tmp_path)
    before = _tree(tmp_path)
    assert _main(script)(argv) == 2, case
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.splitlines()) == 1, (case, err)
    assert "not a regular file" in err or "exists" in err, (case, err)  # for this reason
    assert _tree(tmp_path) == before, case


# ------------------------------------------------------- a link among an output's folders
# name -> (command, argv); a folder the command writes into is a link to a folder it does not
# read, so only this guard stands between the command and the link's target.
LINKS: dict[str, tuple[str, Case]] = {
    "align: DST/anna a link": (
        "facenet-align",
        lambda d: [
            _faces(d / "faces"),
            str(_link(_folder(d / "elsewhere"), d / "crops" / "anna").parent),
            "--no-progress",
        ],
    ),
    "make-templates: DST/loose_crop a link": (
        "facenet-make-templates",
        lambda d: [
            _faces(d / "faces"),
            str(_link(_folder(d / "elsewhere"), d / "set" / "loose_crop").parent),
            *("--overwrite", "--no-progress"),
        ],
    ),
}


def _folder(path: Path) -> Path:
    path.mkdir(parents=True)
    return path


@pytest.mark.parametrize("case", LINKS)
def test_a_link_among_the_output_folders_is_refused(case, tmp_path, capsys):
    script, build = LINKS[case]
    argv = build(tmp_path)
    before = _tree(tmp_path)
    assert _main(script)(argv) == 2, case
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.splitlines()) == 1, (case, err)
    assert "is a symbolic link inside" in err, (case, err)
    assert _tree(tmp_path) == before, case


# ------------------------------------------------- a declared count past what the file holds
def test_a_pairs_header_promising_more_pairs_than_lines_is_one_line(tmp_path):
    pairs = tmp_path / "pairs.txt"
    pairs.write_text("1000000000\t300\nanna\t1\t2\nanna\t1\tbob\t1\n")
    with pytest.raises(DataError, match="header promises .* but the file holds 2"):
        read_pairs(pairs)


def test_a_recordio_index_naming_more_records_than_the_rec_holds_is_refused(tmp_path):
    record = encode_record(image_payload(b"\x89PNG\r\n\x1a\n" + bytes(8), 0, 0))
    (tmp_path / "train.rec").write_bytes(record)
    keys = range(1 + len(record) // 8)  # each key at the one record
    (tmp_path / "train.idx").write_text("".join(f"{key}\t0\n" for key in keys))
    with pytest.raises(DataError, match=r"train.idx: \d+ records, more than train.rec's"):
        open_recordio(tmp_path)
