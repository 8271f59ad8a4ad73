"""The run directory: created, locked by the process that trains in it, cleared on --overwrite.

The lock is an exclusive ``flock`` on ``.lock``, held for the life of the run by the training
process (rank 0), with its pid and host name written in the file for messages. The kernel
releases the lock when the process ends in any way (a crash, ``kill -9``), so there is no stale
lock to detect and nothing to race over: of two runs started at once, one gets the lock, the
other is refused with a message naming the directory and the holder's pid. (``flock`` is
local to a machine; on a network file system shared between machines it may not exclude.)
"""

from __future__ import annotations

import contextlib
import fcntl
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
    "heldout.json",
    "holdout.json",  # heldout.json's name in runs written before the rename
    "val_pairs.txt",
    "test_pairs.txt",
    "roc_*.png",
    "tensorboard",
)


class RunDirLocked(FacenetError):
    """Another live process trains in this run directory."""


class RunDirLock:
    """An exclusive lock on a run directory for the life of a ``with`` block.

    Args:
        run_dir: the run directory (must exist).
    """

    def __init__(self, run_dir: str | os.PathLike):
        self.path = Path(run_dir) / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock.

        Raises:
            RunDirLocked: another process holds it (the message names the directory and pid).
            OSError: the lock file cannot be opened (a read-only folder, a directory there).
        """
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
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
            # The holder may have removed the file between our open and our lock: then we
            # locked a file nobody else will open; try again on the current one.
            with contextlib.suppress(FileNotFoundError):
                if os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                    break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n{socket.gethostname()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        """Remove the lock file and release the lock, if this process holds it."""
        if self._fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()  # a later opener creates a new file and locks that
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

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
