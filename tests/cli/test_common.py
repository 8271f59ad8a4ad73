"""The commands' shared layer (facenet.cli.common), the console entry points in pyproject.toml,
the scripts/ shims, and no ``sys.path`` edits left in the package, the scripts or the tests."""

from __future__ import annotations

import argparse
import ast
import errno
import subprocess
import sys
import warnings
from importlib import import_module
from pathlib import Path

import pytest
import torch

from facenet.cli.common import add_device_argument, parse_device, run_command
from facenet.errors import ConfigError, FacenetError

ROOT = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------- run_command


def _raise(err: BaseException):
    def body():
        raise err

    return body


def test_a_user_error_is_one_error_line_and_exit_code_2(capsys):
    assert run_command(_raise(ConfigError("a.yaml: line 3\n  key: [\n       ^\nbad"))) == 2
    assert capsys.readouterr().err == "error: a.yaml: line 3 key: [ bad\n"
    assert run_command(_raise(FacenetError("plain"))) == 2
    assert capsys.readouterr().err == "error: plain\n"


def test_an_os_error_names_its_file_and_reason(capsys):
    err = FileNotFoundError(errno.ENOENT, "No such file or directory", "/no/such.pt")
    assert run_command(_raise(err)) == 2
    assert capsys.readouterr().err == "error: /no/such.pt: No such file or directory\n"
    assert run_command(_raise(OSError("disk on fire"))) == 2  # no file name: the text
    assert capsys.readouterr().err == "error: disk on fire\n"


def test_any_other_exception_is_a_bug_and_propagates(capsys):
    with pytest.raises(ValueError, match="invariant"):
        run_command(_raise(ValueError("invariant broken")))
    assert capsys.readouterr().err == ""


def test_the_body_s_exit_code_is_returned_and_none_is_0():
    assert run_command(lambda: None) == 0
    assert run_command(lambda: 3) == 3


def test_warnings_are_one_line_and_the_handler_is_restored(capsys):
    before = warnings.showwarning

    def body():
        warnings.warn("the folder holds 2 identities", UserWarning, stacklevel=1)
        return 0

    assert run_command(body) == 0
    assert capsys.readouterr().err == "warning: the folder holds 2 identities\n"
    assert warnings.showwarning is before


# --------------------------------------------------------------------------- --device


def test_parse_device_and_the_device_argument():
    assert parse_device("cpu") == torch.device("cpu")
    with pytest.raises(FacenetError, match="--device 'nonsense'"):
        parse_device("nonsense")
    parser = argparse.ArgumentParser()
    add_device_argument(parser, "auto")
    assert parser.parse_args([]).device == "auto"
    assert parser.parse_args(["--device", "cuda:1"]).device == "cuda:1"


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present here")
def test_cuda_where_there_is_none_is_a_user_error_naming_the_value():
    with pytest.raises(FacenetError, match="--device 'cuda'"):
        parse_device("cuda")


# --------------------------------------------------------------------------- entry points


def console_scripts() -> dict[str, str]:
    """``[project.scripts]`` of pyproject.toml: command name -> ``module:function``."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    with open(ROOT / "pyproject.toml", "rb") as fh:
        return tomllib.load(fh)["project"]["scripts"]


def test_every_console_script_imports_and_its_target_is_callable():
    scripts = console_scripts()
    assert "facenet-train" in scripts and "facenet-evaluate" in scripts
    for name, target in scripts.items():
        module_name, _, function = target.partition(":")
        assert callable(getattr(import_module(module_name), function)), name


def test_every_command_module_has_a_console_script_and_a_shim():
    shared = {"__init__", "common"}
    commands = {p.stem for p in (ROOT / "facenet" / "cli").glob("*.py")} - shared
    targets = {target.partition(":")[0] for target in console_scripts().values()}
    assert targets == {f"facenet.cli.{name}" for name in commands}
    for name in commands:
        # facenet-make-pairs <-> facenet.cli.make_pairs <-> scripts/make_pairs.py
        assert f"facenet-{name.replace('_', '-')}" in console_scripts()
        assert (ROOT / "scripts" / f"{name}.py").is_file() or name == "evaluate", name


def test_the_scripts_are_shims_that_run_only_as_the_main_script():
    for path in sorted((ROOT / "scripts").glob("*.py")):
        body = ast.parse(path.read_text(encoding="utf-8")).body
        docstring, imported, guard = body  # nothing else: the code lives in facenet.cli
        assert isinstance(docstring, ast.Expr) and "facenet-" in docstring.value.value, path
        assert isinstance(imported, ast.ImportFrom), path
        assert imported.module == f"facenet.cli.{path.stem}", path
        # spawned workers (align --workers) import the main script again: it must not run
        assert isinstance(guard, ast.If) and "__main__" in ast.unparse(guard.test), path


@pytest.mark.parametrize("how", ["console script", "scripts/ shim"])
def test_a_command_exits_2_with_one_error_line_from_a_subprocess(how, tmp_path):
    bin_dir = Path(sys.executable).parent
    command = {
        "console script": [str(bin_dir / "facenet-make-pairs")],
        "scripts/ shim": [sys.executable, str(ROOT / "scripts" / "make_pairs.py")],
    }[how]
    proc = subprocess.run(
        [*command, str(tmp_path / "absent")], capture_output=True, text=True, cwd=tmp_path
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "absent" in lines[0]


# --------------------------------------------------------------------------- sys.path


def test_no_sys_path_insert_anywhere():
    needle = "sys.path" + ".insert"  # spelt in two parts: this file does not match itself
    found = []
    for folder in ("facenet", "scripts", "tests", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            relative = path.relative_to(ROOT).as_posix()
            text = path.read_text(encoding="utf-8")
            found += [
                f"{relative}:{i}" for i, line in enumerate(text.splitlines(), 1) if needle in line
            ]
    assert found == []
