"""Errors a user can cause: a bad configuration, image, pairs file, checkpoint or weights file,
a run of non-finite losses. The commands print these, and only these, as one line with exit
code 2 (3 for :class:`NonFiniteLossError`); anything else is a bug and keeps its traceback.
Each class also derives from the built-in exception callers caught before (``ValueError``, ...).
"""

from __future__ import annotations

import reprlib
from typing import Any

EXIT_BAD_INPUT = 2


class _Repr(reprlib.Repr):
    def repr_int(self, x: int, level: int) -> str:  # repr() of 5000 digits raises ValueError
        return super().repr_int(x, level) if x.bit_length() < 128 else "<a huge integer>"


_REPR = _Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 3, 80, 80


def shown(value: Any) -> str:
    """``repr(value)`` for a message, cut to about 200 characters and never built whole: a
    crafted file can nest or repeat a value a million times."""
    text = _REPR.repr(value)
    return text if len(text) <= 200 else text[:200] + "..."


def some_names(names: list, shown: int = 8) -> str:
    """The first ``shown`` names (or values) and how many more, as "a, b (and 7 more)"."""
    more = f" (and {len(names) - shown} more)" if len(names) > shown else ""
    return ", ".join(map(str, names[:shown])) + more


def one_line(err: BaseException | str) -> str:
    """A message on one line: an ``OSError`` as ``file: reason``; lines joined, caret lines (a
    YAML error's) dropped."""
    if isinstance(err, OSError) and err.filename and err.strerror:
        return f"{err.filename}: {err.strerror}"
    lines = [line.strip() for line in str(err).splitlines()]
    text = " ".join(line for line in lines if line and set(line) != {"^"})
    return text or type(err).__name__


class FacenetError(Exception):
    """A problem with the input or the environment, reported in one line.

    ``checkpoint_note``: where the run saved its last finished step before the error
    propagated; ``agreed``: every rank raises it at the same point (rank 0 alone reports it).
    """

    checkpoint_note: str | None = None
    agreed: bool = False


class ConfigError(FacenetError, ValueError):
    """The message names the key, the value and the file."""


class DataError(FacenetError, ValueError):
    """Images, folders or pairs files that cannot be used; the message names the file."""


class CheckpointError(FacenetError, RuntimeError):
    """A checkpoint could not be written, or was refused on loading."""


class WeightsError(FacenetError, ValueError):
    """A weights file that cannot be loaded into the model (refused, damaged or mismatched)."""


class NonFiniteLossError(FacenetError, RuntimeError):
    """Too many steps in a row had a non-finite loss; the run stops (exit code 3)."""


class NonFiniteInputError(DataError):
    """Input images holding NaN or infinite values after the transform; ``rows``: their batch
    rows, when known."""

    def __init__(self, message: str, rows: list[int] | None = None):
        super().__init__(message)
        self.rows = list(rows or [])


class RankFailure(FacenetError):
    """Another rank stopped with an error; this rank stops at the same point.
    ``checkpointable``: every rank stands at a finished step (False when the other rank's
    error is a bug: it leaves without a checkpoint)."""

    def __init__(self, message: str, checkpointable: bool = True):
        super().__init__(message)
        self.checkpointable = checkpointable
        self.agreed = True
