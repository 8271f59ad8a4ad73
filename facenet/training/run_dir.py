"""The run directory: created, locked by the process that trains in it, cleared on --overwrite.

``--overwrite`` removes exactly what the previous run recorded writing (``outputs.json``), when
the new run first writes (after its configuration, data and model were checked), and never a
path the new configuration reads. The lock is an exclusive ``flock`` on ``.lock`` held by rank
0 for the life of the run: the kernel releases it however the process ends, so there is no
stale lock (``flock`` is local to a machine: on a network file system it may not exclude).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import socket
import stat
from collections.abc import Iterable
from fnmatch import fnmatch
from pathlib import Path

from facenet.checkpoint import load_checkpoint
from facenet.distributed import agree_on_error
from facenet.errors import FacenetError
from facenet.files import read_json, write_text_atomic

LOCK_NAME = ".lock"
_LOCK_TEXT = re.compile(rb"(\d+\n[^\n]{0,255}\n)?")  # pid, host; empty: killed before writing
OUTPUTS_RECORD = "outputs.json"
_RECORD_FORMAT = "facenet-run-outputs"
# What runs wrote before they kept a record (removed only where last.pt shows a run).
LEGACY_RUN_OUTPUTS = (
    "last.pt",
    "best.pt",
    "nonfinite.pt",
    "metrics.jsonl",
    "summary.json",
    "heldout.json",
    "holdout.json",  # heldout.json's name in runs written before the rename
    "config.yaml",  # the run's resolved configuration (the new run writes its own)
    "val_pairs.txt",
    "test_pairs.txt",
    "roc_*.png",
    "tensorboard",
)
# The ROC figures a run writes (older records name them "roc_*.png").
_RUN_FIGURE = re.compile(r"roc_(val_epoch_\d+|test)\.png")
_EVENT_FILE = "events.out.tfevents.*"  # TensorBoard's, in the recorded tensorboard/


class RunDirLocked(FacenetError):
    """Another live process trains in this run directory."""


class NotARunOutput(FacenetError):
    """A file the run would write exists, and no run recorded writing it."""


# Lock descriptors this process holds. An flock lasts while any copy is open: a forked child
# (a DataLoader worker) outliving a killed run would keep it, so children close their copies.
_HELD_FDS: set[int] = set()


def _close_inherited_locks() -> None:
    for fd in _HELD_FDS:
        with contextlib.suppress(OSError):
            os.close(fd)  # this copy only: the parent still holds the lock
    _HELD_FDS.clear()


os.register_at_fork(after_in_child=_close_inherited_locks)


def _not_a_lock(path: Path) -> str:
    return (
        f"{path} exists and is not a run's lock file (a pid and a host name): move it away, "
        "or choose another --out"
    )


class RunDirLock:
    """An exclusive lock on an existing run directory for the life of a ``with`` block."""

    def __init__(self, run_dir: str | os.PathLike):
        self.path = Path(run_dir) / LOCK_NAME
        self._fd: int | None = None
        self._created = False

    def acquire(self) -> None:
        """Take the lock, or raise RunDirLocked naming the holder's pid, NotARunOutput when
        ``.lock`` is not a lock file of a run (left as it is; OSError when it cannot be made)."""
        while True:
            fd = self._open()
            if fd is None:
                continue  # the holder removed its lock file between our two opens
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 200).decode("utf-8", "replace").split()
                os.close(fd)
                who = f"process {holder[0]} on {holder[1]}" if len(holder) >= 2 else "a process"
                raise RunDirLocked(
                    f"{self.path.parent} is in use by {who} (lock file {self.path}); wait for "
                    "it to end, or choose another --out"
                ) from None
            # The holder may have removed the file between our open and lock: try again.
            if self._is_ours(fd):
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n{socket.gethostname()}\n".encode())
        self._fd = fd
        _HELD_FDS.add(fd)

    def _open(self) -> int | None:
        """The lock file, created exclusively, or the existing one, never through a link
        (O_NOFOLLOW); None when it vanished meanwhile."""
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK
        with contextlib.suppress(FileExistsError):
            fd = os.open(self.path, flags | os.O_CREAT | os.O_EXCL, 0o644)
            self._created = True
            return fd
        self._created = False  # a killed run's: taken over, left in place
        try:
            return os.open(self.path, flags)
        except FileNotFoundError:
            return None
        except OSError:  # a symbolic link (ELOOP), a folder
            raise NotARunOutput(_not_a_lock(self.path)) from None

    def _is_ours(self, fd: int) -> bool:
        """Whether the locked ``fd`` is still ``.lock``; NotARunOutput when it is not a regular
        file holding what runs write (nothing, or a pid and a host)."""
        with contextlib.suppress(FileNotFoundError):
            if os.stat(self.path, follow_symlinks=False).st_ino != os.fstat(fd).st_ino:
                return False
            if not stat.S_ISREG(os.fstat(fd).st_mode) or not _LOCK_TEXT.fullmatch(
                os.pread(fd, 300, 0)
            ):
                os.close(fd)
                raise NotARunOutput(_not_a_lock(self.path))
            return True
        return False

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            if self._created and self.path.lstat().st_ino == os.fstat(self._fd).st_ino:
                self.path.unlink()  # ours: a later opener creates a new file and locks that
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        _HELD_FDS.discard(self._fd)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> RunDirLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _recorded(run_dir: Path) -> list[str] | None:
    try:  # a regular file of bounded size: a FIFO or a huge record is no record
        record = read_json(run_dir / OUTPUTS_RECORD)
    except (OSError, ValueError):  # DataError is a ValueError
        return None
    if not isinstance(record, dict) or record.get("format") != _RECORD_FORMAT:
        return None
    names = record.get("outputs")
    return [n for n in names if isinstance(n, str)] if isinstance(names, list) else None


def _previous_outputs(run_dir: Path) -> list[str]:
    """The names recorded in the run directory; without a record, the ``LEGACY_RUN_OUTPUTS``
    there when ``last.pt`` is a training checkpoint of this package (read without running code)."""
    names, path = _recorded(run_dir), run_dir / "last.pt"
    if names is not None or not path.is_file():
        return names or []
    try:
        state = load_checkpoint(path)
    except (FacenetError, OSError):
        return []
    if not (isinstance(state, dict) and "model" in state and "config" in state):
        return []
    return [n for n in LEGACY_RUN_OUTPUTS if any(run_dir.glob(n))]


def _matches(name: str, recorded: str) -> bool:
    """A recorded pattern (``roc_*.png`` of older records) covers only names runs write."""
    return name == recorded or (fnmatch(name, recorded) and bool(_RUN_FIGURE.fullmatch(name)))


def _foreign_entry(folder: Path) -> Path | None:
    """The first entry under a recorded ``folder`` that is not a TensorBoard event file, all
    that runs write in one."""
    for path in folder.rglob("*"):
        if path.is_symlink() or not (
            path.is_dir() or path.is_file() and fnmatch(path.name, _EVENT_FILE)
        ):
            return path
    return None


def _previous_paths(run_dir: Path, names: list[str], keep: list[Path]) -> list[Path]:
    """The entries of ``run_dir`` that ``names`` (a record) covers, except those leading out
    of it or holding a path the new run reads; NotARunOutput when a recorded folder holds an
    entry no run wrote."""
    base, paths = run_dir.resolve(), []
    for name in names:
        if not name or "/" in name or "\\" in name or name in (".", ".."):
            continue  # a record names entries of the run directory itself, nothing else
        for path in sorted(p for p in run_dir.glob(name) if _matches(p.name, name)):
            # The entry itself (a link, not its target) must lie in the run directory.
            real = Path(os.path.realpath(path.parent)) / path.name
            if not real.parent.is_relative_to(base):
                continue  # a name leading out of the run directory
            target = os.path.realpath(path)
            if any(k.is_relative_to(target) or k.is_relative_to(real) for k in keep):
                continue  # the new run reads it (or something inside it)
            foreign = _foreign_entry(path) if path.is_dir() and not path.is_symlink() else None
            if foreign:
                raise NotARunOutput(
                    f"{foreign} is in {path}, which --overwrite removes, and no run wrote it: "
                    "move it away, or choose another --out"
                )
            paths.append(path)
    return paths


def clear_previous_outputs(run_dir: str | os.PathLike, keep: Iterable = ()) -> list[Path]:
    """Remove what the previous run recorded writing here, and the record; the removed paths.

    Names that leave the run directory, and the paths the new run reads (``keep``, or a
    folder holding one), stay. A directory without a record loses nothing, unless its
    ``last.pt`` is a training checkpoint from before records were kept: then the names such
    runs wrote (``LEGACY_RUN_OUTPUTS``) go. A recorded folder holding anything but TensorBoard
    event files refuses the whole removal (NotARunOutput), removing nothing.
    """
    run_dir = Path(run_dir)
    kept = [Path(os.path.realpath(k)) for k in keep if k]
    removed = _previous_paths(run_dir, _previous_outputs(run_dir), kept)
    for path in removed:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    with contextlib.suppress(FileNotFoundError):
        (run_dir / OUTPUTS_RECORD).unlink()
    return removed


class RunOutputs:
    """The record of what a run writes in its directory, kept in ``outputs.json``.

    :meth:`plan` checks names before anything is written or removed; :meth:`add` records a
    name just before it is written. The first ``add`` begins the run's writing: with
    ``clear_previous`` (``--overwrite``) the previous run's outputs are removed then, except
    the paths the configuration reads (``keep``). ``enabled``: rank 0.
    """

    def __init__(self, run_dir, clear_previous: bool = False, keep: Iterable = (), enabled=True):
        self.run_dir, self.clear_previous = Path(run_dir), clear_previous
        self.keep = [Path(os.path.realpath(k)) for k in keep if k]
        self.enabled, self.planned = enabled, []
        self.names: list[str] | None = None  # None until the first write
        self.removed: list[Path] = []
        self._previous: list[str] | None = None

    def plan(self, names: Iterable[str]) -> None:
        """Refuse (NotARunOutput), before the run writes or removes anything, a name that is
        not the run's to write: an entry no run recorded, or one the configuration reads.
        Every rank calls it (a collective): all stop when rank 0 refuses."""
        error = None
        try:
            self._check(names)
        except NotARunOutput as err:
            error = err
        agree_on_error(error)

    def _check(self, names: Iterable[str]) -> None:
        if not self.enabled:
            return
        if self._previous is None:
            self._previous = _previous_outputs(self.run_dir)
        if self.clear_previous and self.names is None:  # before anything is removed
            _previous_paths(self.run_dir, self._previous, self.keep)
        ours = self._previous if self.names is None else self.names
        for name in names:
            target = self.run_dir / name
            foreign = not any(_matches(name, n) for n in ours) and "*" not in name
            if foreign and (target.exists() or target.is_symlink()):
                raise NotARunOutput(
                    f"{target} exists and no run recorded writing it (in {OUTPUTS_RECORD}); "
                    "the run would replace it: move it away, or choose another --out"
                )
            read = [k for k in self.keep if k.is_relative_to(os.path.realpath(target))]
            if read:
                raise NotARunOutput(
                    f"{target} would be replaced by the run, and its configuration reads "
                    f"{read[0]}: copy it out of the run directory and point the configuration there"
                )
            if name not in self.planned:
                self.planned.append(name)

    def add(self, path: str | os.PathLike) -> None:
        """Record ``path`` (a file or folder directly in the run directory) as written by this
        run, after :meth:`plan`; begins the run's writing if needed."""
        if not self.enabled:
            return
        self._check([Path(path).name])
        if self.names is None:
            if self.clear_previous:
                self.removed = clear_previous_outputs(self.run_dir, self.keep)
                self._previous = []
            self.names = list(self._previous)
        self.names += [n for n in self.planned if n not in self.names]
        self._save()

    def _save(self) -> None:
        record = {"format": _RECORD_FORMAT, "version": 1, "outputs": self.names}
        write_text_atomic(self.run_dir / OUTPUTS_RECORD, json.dumps(record, indent=1))
