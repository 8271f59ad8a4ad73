"""Every shell command that README.md and docs/*.md show for a ``facenet-*`` console script
(or ``torchrun ... -m facenet.cli.<name>``) parses with that command's own parser, so a flag
renamed in the code and not in a document fails here; the ones the project's small data can
run are run, in a temporary folder, on the tiny demo run of tests/conftest.py.

A documented command is named by its normalised text (continuations joined, the comment cut,
spaces collapsed). ``[...]`` marks optional arguments in the documents: they are parsed, and
left out where the command is run (``[--flip]`` would not match the checkpoint's threshold).
"""

from __future__ import annotations

import importlib
import re
import shlex
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL = {"", "bash", "sh", "shell", "console"}  # a fence's language: shell, or none given
MODULE = re.compile(r"-m facenet\.cli\.(\w+)")
PLACEHOLDERS = {"N": "1", "...": None}  # "[--threads N]": a number; "...": more of the above

# The documented commands the small data runs, and what each path becomes: the tiny run's
# checkpoint, held-out folder and pairs file; outputs stay relative, inside the test's folder.
RUNNABLE = {
    "facenet-evaluate --checkpoint runs/demo/best.pt --pairs lfw/pairs.txt --out runs/eval",
    "facenet-evaluate --checkpoint runs/demo/best.pt --retrieval ROOT --out runs/retrieval",
    "facenet-embed --checkpoint runs/demo/best.pt --images faces/ --out faces.npz [--flip]",
    "facenet-identify --gallery enrolled.npz --probes faces.npz --out runs/identify",
    "facenet-export --checkpoint runs/demo/best.pt --format weights --out model.pt",
}

# Each other command needs data the tests do not have: the first name it holds says which.
NEEDS = {
    "configs/demo.yaml": "the demo's full run (minutes: `make train`)",
    "scores.npz": "a user's distances file",
    "IJBC": "the IJB-C set",
    "--ijb": "an IJB-style set of templates",
    "--bin": "insightface's .bin sets",
    "--format onnx": "the optional onnx packages",
    "--format pt2": "a torch.export of the model (minutes)",
    "make-pairs ROOT": "a folder with 10 folds x 300 pairs of identities",
    "lfw/ ": "LFW's photos",
    "lfw150/": "LFW's photos",
    "lfw_grouped/": "LFW's photos",
    "celeba": "CelebA's photos",
    "graph_final.pb": "sandberg's TensorFlow graph",
    ".pb ": "sandberg's TensorFlow graph",
    "model-20180402": "sandberg's TensorFlow checkpoint",
    "20180402-114759-vggface2.pt": "facenet-pytorch's weights",
    "20180408-102900.pt": "sandberg's converted weights",
    "068.ckpt": "MobileFaceNet's weights",
    "model.pt --": "trained weights of a real model",
    "configs/casia_resnet50.yaml": "CASIA-WebFace and several GPUs",
    "configs/real_faces.yaml": "CelebA's and LFW's photos",
    "SRC DST": "a folder of photos",
    "my_faces": "the user's own photos",
    "--checkpoint finetune/": "a run of benchmarks.bench_finetune on the shared real faces",
}


def arguments(words: list[str], optional: bool) -> list[str]:
    """``words`` with the brackets of optional arguments (``[--name templates]``) dropped, and
    the optional arguments themselves unless ``optional``."""
    kept, depth = [], 0
    for word in words:
        depth += word.count("[")
        if optional or depth == 0:
            kept.append(word.strip("[]"))
        depth -= word.count("]")
    return [word for word in kept if word]


def shell_blocks(text: str):
    """``(line number of the opening fence, body)`` of each fenced block marked as shell or not
    marked at all; fences are paired in order, so a ``python`` block's closing fence is never
    taken for an opening one."""
    opening, lines = None, []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.startswith("```"):
            lines.append(line)
        elif opening is None:
            opening, lines = (number, line[3:].strip()), []
        else:
            if opening[1] in SHELL:
                yield opening[0], "\n".join(lines)
            opening = None


def documented_commands() -> dict[str, tuple[str, str, list[str]]]:
    """Normalised text -> (where: the document and its code block's opening line, module name
    under facenet.cli, its words after the command) of every documented command of this
    package."""
    found = {}
    for document in DOCUMENTS:
        for number, body in shell_blocks(document.read_text()):
            for line in body.replace("\\\n", " ").splitlines():
                name = Path(line.split(maxsplit=1)[0]).name if line.strip() else ""
                if not name.startswith("facenet-") and name != "torchrun":
                    continue  # prose, a tree listing, another program
                words = shlex.split(line, comments=True)
                if name.startswith("facenet-"):
                    module, words = name[len("facenet-") :].replace("-", "_"), words[1:]
                elif match := MODULE.search(line):
                    module, words = match.group(1), words[words.index("-m") + 2 :]
                else:
                    continue
                where = f"{document.relative_to(ROOT)}:{number}"
                found.setdefault(" ".join(line.split("#")[0].split()), (where, module, words))
    return found


COMMANDS = documented_commands()


def _parser(module: str):
    return importlib.import_module(f"facenet.cli.{module}").get_args_parser()


def test_the_documents_show_every_command():
    shown = {module for _, module, _ in COMMANDS.values()}
    assert {"train", "evaluate", "embed", "identify", "export", "align", "convert"} <= shown
    assert RUNNABLE <= set(COMMANDS), sorted(RUNNABLE - set(COMMANDS))


@pytest.mark.parametrize("command", sorted(COMMANDS), ids=str)
def test_a_documented_command_parses(command, capsys):
    where, module, words = COMMANDS[command]
    argv = [PLACEHOLDERS.get(word, word) for word in arguments(words, optional=True)]
    try:
        _parser(module).parse_args([word for word in argv if word is not None])
    except SystemExit:
        pytest.fail(f"{where}: {command}: {capsys.readouterr().err.strip().splitlines()[-1]}")


@pytest.mark.parametrize("command", sorted(set(COMMANDS) - RUNNABLE), ids=str)
def test_a_command_not_run_says_which_data_it_needs(command):
    assert any(name in command for name in NEEDS), f"{COMMANDS[command][0]}: {command}"


def test_every_named_need_is_a_documented_command_s():
    unused = [name for name in NEEDS if not any(name in command for command in COMMANDS)]
    assert not unused, f"NEEDS names no documented command: {unused}"


@pytest.mark.usefixtures("one_thread")
def test_the_runnable_commands_run_on_small_data(tiny_run, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    faces = tmp_path / "faces"
    shutil.copytree(tiny_run["heldout"], faces)
    small = {
        "runs/demo/best.pt": str(tiny_run["checkpoint"]),
        "lfw/pairs.txt": str(faces / tiny_run["pairs"].name),
        "ROOT": str(faces),
        "faces/": str(faces),
        "enrolled.npz": "faces.npz",  # the gallery: the same faces, embedded by the line above
    }
    for command in sorted(RUNNABLE, key=list(COMMANDS).index):  # in the documents' order
        where, module, words = COMMANDS[command]
        main = importlib.import_module(f"facenet.cli.{module}").main
        argv = [small.get(word, word) for word in arguments(words, optional=False)]
        assert main(argv) == 0, f"{where}: {command}"
