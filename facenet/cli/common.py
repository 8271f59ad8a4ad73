"""What every command shares: glibc's malloc set up for tensor work
(:func:`facenet.memory.keep_freed_memory`),
user errors as one ``error:`` line with exit code 2, warnings as one ``warning:`` line, the
``--device``, ``--threads``, ``--out`` and ``--overwrite`` arguments, and the check, before any
work, that nothing but a command's own earlier output is replaced. A command's ``main(argv)`` is
``run_command(lambda: _main(args))``: a ``FacenetError`` or a file-system error becomes that
line; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from facenet.config import max_threads
from facenet.data.pairs import MissingImagesError, PairList, read_pairs
from facenet.distributed import resolve_device
from facenet.errors import EXIT_BAD_INPUT, DataError, FacenetError, one_line
from facenet.files import Inputs, check_no_links_below, check_not_inputs
from facenet.memory import keep_freed_memory


@contextlib.contextmanager
def one_line_warnings():
    """The block every command runs in: malloc keeps freed memory (``keep_freed_memory``: the
    commands' tensor work, not the library's importers), and warnings print as one
    ``warning: <message>`` line on stderr."""
    with warnings.catch_warnings():
        warnings.showwarning = lambda message, *_, file=None, **__: print(
            f"warning: {message}", file=sys.stderr if file is None else file
        )
        keep_freed_memory()
        yield


def run_command(body: Callable[[], int | None]) -> int:
    """``body()``'s exit code (None: 0), or 2 with one ``error:`` line for a user error."""
    with one_line_warnings():
        try:
            code = body()
        except (FacenetError, OSError) as err:  # anything else is a bug: keep its traceback
            return report_error(err)
    return 0 if code is None else code


def report_error(err: BaseException) -> int:
    """Print a user error as one ``error:`` line on stderr; return exit code 2."""
    print(f"error: {one_line(err)}", file=sys.stderr)
    return EXIT_BAD_INPUT


def add_device_argument(parser: argparse.ArgumentParser, default: str = "cpu") -> None:
    parser.add_argument(
        "--device",
        default=default,
        help=f"torch device: cpu, cuda, cuda:N or auto (default {default})",
    )


def add_threads_argument(parser: argparse.ArgumentParser) -> None:
    """``--threads N``, at most :func:`facenet.config.max_threads` (4 per CPU core)."""
    parser.add_argument(
        "--threads",
        type=int_in(0, max_threads()),
        default=1,
        metavar="N",
        help="torch CPU threads (default 1: holds on a busy machine; 0: torch's default)",
    )


def add_out_arguments(
    parser: argparse.ArgumentParser, what: str, default: str | None = None
) -> None:
    """``--out`` (required without a ``default``) and ``--overwrite``."""
    parser.add_argument("--out", default=default, required=default is None, help=what)
    parser.add_argument(
        "--overwrite", action="store_true", help="replace this command's earlier outputs"
    )


def check_out(out: Path) -> None:
    """Refuse, before any work and creating nothing, an ``--out`` whose nearest existing
    parent is not a writable folder."""
    existing = out
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise DataError(f"--out {out}: {existing} is not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise DataError(f"--out {out}: {existing} cannot be written")


def check_outputs(
    args: argparse.Namespace,
    *names: str,
    files: Inputs | None = None,
    folders: Inputs | None = None,
) -> None:
    """Refuse, before any work, to replace anything but this command's earlier output. The
    outputs are the files ``names`` in the folder ``args.out``, or without names ``args.out``
    itself; one that exists (a dangling link too) is refused unless ``args.overwrite``, and even
    then all but a regular file (a link is never written through); so is an unwritable folder,
    an output that is one of the input ``files`` or ``folders`` or lies inside one of the
    ``folders`` (:func:`facenet.files.check_not_inputs`), and a link among the folders between
    ``args.out`` and an output."""
    outputs = [Path(args.out, name) for name in names] or [Path(args.out)]
    for path in outputs:
        check_out(path.parent)
        replaceable = args.overwrite and path.is_file() and not path.is_symlink()
        if os.path.lexists(path) and not replaceable:
            how = (
                " and is not a regular file:" if args.overwrite else ": --overwrite replaces it, or"
            )
            raise DataError(f"{path} exists{how} choose another --out")
    check_not_inputs(outputs, files or {}, folders)
    check_no_links_below(args.out, outputs)


def int_in(low: int, high: int | None = None, zero: bool = False) -> Callable[[str], int]:
    """An argparse ``type``: an integer in ``low..high``, or 0 with ``zero`` (else an argparse
    error, exit 2)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not low <= value <= (value if high is None else high) and not (zero and value == 0):
            allowed = f">= {low}" if high is None else f"[{low}, {high}]"
            raise argparse.ArgumentTypeError(
                f"{value} is out of range; allowed: {'0 or ' * zero}{allowed}"
            )
        return value

    return parse


positive_int = int_in(1)


def parse_device(name: str) -> torch.device:
    """The torch device of ``--device``; an unknown name, or CUDA where there is none, is a user
    error."""
    try:
        return resolve_device(name)
    except (RuntimeError, FacenetError) as err:
        raise FacenetError(f"--device {name!r}: {str(err).splitlines()[0]}") from None


def read_pairs_of(args: argparse.Namespace) -> PairList:
    """The pairs of ``--pairs`` (images under ``--root``, or the folder the file names); a
    missing image is one line naming the options a command-line user types (``--root``,
    ``--skip-missing``), not the library's keywords."""
    try:
        return read_pairs(args.pairs, root=args.root, skip_missing=args.skip_missing)
    except MissingImagesError as err:
        raise DataError(err.named("--root", "--skip-missing")) from None
