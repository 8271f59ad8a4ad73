"""facenet-evaluate, -identify, -embed and -export replace nothing they did not write: every
output name is checked before any work; ``--overwrite`` replaces regular files only."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from facenet.cli import embed, evaluate, export, identify

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

COMMANDS = ("evaluate", "evaluate --bin", "identify", "embed", "export")


def command(name: str, tmp_path: Path, tiny_run=None) -> tuple:
    """(main, argv, the paths it writes); without ``tiny_run`` its input is missing, so that
    only a check made before any work can answer."""
    inputs = tmp_path / "in"
    inputs.mkdir(exist_ok=True)
    checkpoint = str(tiny_run["checkpoint"] if tiny_run else inputs / "missing.pt")
    out = tmp_path / "out"
    if name == "evaluate":
        distances = inputs / "d.npz"
        if tiny_run:
            issame = np.arange(40) % 2 == 0
            np.savez(distances, distances=np.where(issame, 0.5, 1.5), issame=issame)
        argv = ["--distances", str(distances), "--folds", "2", "--out", str(out)]
        return evaluate.main, argv, [out / "metrics.json", out / "roc.png"]
    if name == "evaluate --bin":  # refusals only: no .bin is read
        argv = ["--checkpoint", checkpoint, "--bin", str(inputs / "lfw.bin"), "--out", str(out)]
        return evaluate.main, argv, [out / "metrics.json", out / "roc_lfw.png"]
    if name == "identify":
        gallery = inputs / "g.npz"
        if tiny_run:
            np.savez(
                gallery,
                embeddings=np.eye(2, dtype=np.float32),
                labels=["a", "b"],
                weights_sha256="a" * 64,
            )
        argv = ["--gallery", str(gallery), "--probes", str(gallery), "--threshold", "0.5"]
        return (
            identify.main,
            [*argv, "--out", str(out)],
            [out / "matches.csv", out / "identification.json"],
        )
    out = tmp_path / "out.npz"
    if name == "embed":
        images = inputs / "faces"
        if tiny_run:
            identity = sorted(p for p in tiny_run["heldout"].iterdir() if p.is_dir())[0]
            shutil.copytree(identity, images / identity.name)
        argv = ["--checkpoint", checkpoint, "--images", str(images), "--no-progress"]
        return embed.main, [*argv, "--out", str(out)], [out]
    argv = ["--checkpoint", checkpoint, "--format", "weights", "--out", str(out)]
    return export.main, argv, [out]


def tree(root: Path) -> dict:
    """Every path under ``root`` and its bytes (None: not a regular file)."""
    return {
        p: p.read_bytes() if p.is_file() and not p.is_symlink() else None
        for p in sorted(root.rglob("*"))
    }


def refused(main, argv, tmp_path, capsys, says: str) -> None:
    before = tree(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and says in err and len(err.splitlines()) == 1, err
    assert tree(tmp_path) == before  # nothing written, nothing replaced


@pytest.mark.parametrize("name", COMMANDS)
def test_a_users_file_at_any_output_name_is_refused_before_any_work(name, tmp_path, capsys):
    main, argv, outputs = command(name, tmp_path)
    for output in outputs:
        output.parent.mkdir(exist_ok=True)
        output.write_bytes(b"the user's own")
        says = f"{output} exists: --overwrite replaces it, or choose another --out"
        refused(main, argv, tmp_path, capsys, says)
        output.unlink()


@pytest.mark.parametrize("name", ("evaluate", "identify", "embed", "export"))
def test_overwrite_replaces_the_commands_earlier_files(name, tiny_run, tmp_path, capsys):
    main, argv, outputs = command(name, tmp_path, tiny_run)
    assert main(argv) == 0, capsys.readouterr().err
    first = {p: p.read_bytes() for p in outputs}
    for output in outputs:
        output.write_bytes(b"stale")
    assert main([*argv, "--overwrite"]) == 0, capsys.readouterr().err
    assert {p: p.read_bytes() for p in outputs} == first  # rewritten in full
    assert not [p for p in tmp_path.rglob(".*.tmp")]


def make(kind: str, path: Path, target: Path) -> None:
    path.parent.mkdir(exist_ok=True)
    target.parent.mkdir()
    target.write_bytes(b"not to be written through")
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "folder":
        path.mkdir()
    elif kind == "link to a folder":
        path.symlink_to(target.parent, target_is_directory=True)
    else:
        path.symlink_to(target if kind == "link to a file" else target.parent / "nowhere")


@pytest.mark.parametrize(
    "kind", ["fifo", "folder", "link to a file", "dangling link", "link to a folder"]
)
@pytest.mark.parametrize("name", COMMANDS)
def test_anything_but_a_regular_file_is_refused_even_with_overwrite(name, kind, tmp_path, capsys):
    main, argv, outputs = command(name, tmp_path)
    make(kind, outputs[-1], tmp_path / "elsewhere" / "target")
    refused(main, argv, tmp_path, capsys, f"{outputs[-1]} exists: --overwrite replaces it")
    says = f"{outputs[-1]} exists and is not a regular file: choose another --out"
    refused(main, [*argv, "--overwrite"], tmp_path, capsys, says)


@pytest.mark.parametrize("name", COMMANDS)
def test_an_output_folder_that_is_a_file_is_refused_before_any_work(name, tmp_path, capsys):
    main, argv, outputs = command(name, tmp_path)
    blocker = outputs[0].parent if outputs[0].parent != tmp_path else tmp_path / "file"
    blocker.write_bytes(b"the user's own")
    if blocker.name == "file":
        argv[argv.index("--out") + 1] = str(blocker / "out.npz")
    refused(main, [*argv, "--overwrite"], tmp_path, capsys, f"{blocker} is not a folder")


@pytest.mark.parametrize("name", ("evaluate", "identify", "embed", "export"))
def test_overwrite_never_writes_into_a_hard_link(name, tiny_run, tmp_path, capsys):
    """A regular file is replaced whole: another name of the same file keeps its bytes."""
    main, argv, outputs = command(name, tmp_path, tiny_run)
    (tmp_path / "kept").mkdir()
    for i, output in enumerate(outputs):
        output.parent.mkdir(exist_ok=True)
        (tmp_path / "kept" / str(i)).write_bytes(b"the user's own")
        os.link(tmp_path / "kept" / str(i), output)
    assert main([*argv, "--overwrite"]) == 0, capsys.readouterr().err
    kept = [p.read_bytes() for p in (tmp_path / "kept").iterdir()]
    assert kept == [b"the user's own"] * len(outputs)
    assert all(p.read_bytes() != b"the user's own" for p in outputs)
