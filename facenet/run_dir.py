"""The run directory: created, locked by the process that trains in it, cleared on --overwrite.

A lock file ``.lock`` holds the pid and host name of the training process (rank 0). A second
run on the same directory is refused with a message naming the directory and that pid. A lock
left by a process that no longer runs (a crash, ``kill -9``) on this host is stale: it is taken
over, atomically (the stale file is renamed away before a new one is created exclusively).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
from pathlib import Path

from facenet.errors import FacenetError

__all__ = ["RunDirLocked", "RunDirLock", "clear_previous_outputs", "RUN_OUTPUTS"]

LOCK_NAME = ".lock"
# What a run writes into its directory (``--overwrite`` removes them before a new run).
RUN_OUTPUTS = (
    "last.pt",
    "best.pt",
    "nonfinite.pt",
    "metrics.jsonl",
    "summary.json",
    "val_pairs.txt",
    "test_pairs.txt",
    "roc_*.png",
    "tensorboard",
)


class RunDirLocked(FacenetError):
    """Another live process trains in this run directory."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    return True


def _read_lock(path: Path) -> tuple[int, str] | None:
    """(pid, host) of a lock file, or None when it is unreadable or malformed."""
    try:
        pid, host = path.read_text(encoding="utf-8").split("\n")[:2]
        return int(pid), host
    except (OSError, ValueError):
        return None


class RunDirLock:
    """An exclusive lock on a run directory for the life of a ``with`` block.

    Args:
        run_dir: the run directory (must exist).
    """

    def __init__(self, run_dir: str | os.PathLike):
        self.path = Path(run_dir) / LOCK_NAME
        self.owned = False

    def _create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(f"{os.getpid()}\n{socket.gethostname()}\n")
        return True

    def _stale(self) -> bool:
        """True when the lock's owner is gone (this host only: another host's pid is unknown)."""
        owner = _read_lock(self.path)
        if owner is None:
            return True
        pid, host = owner
        return host == socket.gethostname() and pid != os.getpid() and not _pid_alive(pid)

    def acquire(self) -> None:
        """Take the lock, or take over a stale one.

        Raises:
            RunDirLocked: a live process holds it (the message names the directory and pid).
        """
        for _ in range(3):
            if self._create():
                self.owned = True
                return
            if not self._stale():
                owner = _read_lock(self.path)
                who = f"process {owner[0]} on {owner[1]}" if owner else "another process"
                raise RunDirLocked(
                    f"{self.path.parent} is in use by {who} (lock file {self.path}); wait for "
                    "it to end, or choose another --out"
                )
            # Rename the stale lock away first: of two processes taking it over, one wins.
            with contextlib.suppress(FileNotFoundError):
                os.replace(self.path, self.path.with_name(f"{LOCK_NAME}.stale.{os.getpid()}"))
                os.unlink(self.path.with_name(f"{LOCK_NAME}.stale.{os.getpid()}"))
        raise RunDirLocked(f"{self.path.parent}: could not take the lock {self.path}")

    def release(self) -> None:
        """Remove the lock file if this process holds it."""
        if self.owned and _read_lock(self.path) == (os.getpid(), socket.gethostname()):
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
        self.owned = False

    def __enter__(self) -> RunDirLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def clear_previous_outputs(run_dir: str | os.PathLike) -> list[Path]:
    """Remove what an earlier run wrote (checkpoints, logs, figures, TensorBoard events).

    The configuration and the data (e.g. a synthetic set under the run directory) stay.

    Args:
        run_dir: the run directory.

    Returns:
        The removed paths.
    """
    removed = []
    for pattern in RUN_OUTPUTS:
        for path in sorted(Path(run_dir).glob(pattern)):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
            removed.append(path)
    return removed
