"""One family of errors for problems with the user's input or environment.

Every error a user can cause (a mistyped configuration key, a corrupt image, a damaged pairs
file, a refused checkpoint, a weights file that does not fit, a run of non-finite losses)
derives from :class:`FacenetError`. The command-line scripts turn these, and only these, into
one line on stderr and exit code 2 (3 for :class:`NonFiniteLossError`); anything else is a bug
and keeps its traceback. Each class also derives from the built-in exception that callers
caught before this family existed (``ValueError``, ``RuntimeError``, ``FileNotFoundError``).
"""

from __future__ import annotations

__all__ = [
    "FacenetError",
    "ConfigError",
    "DataError",
    "CheckpointError",
    "WeightsError",
    "NonFiniteLossError",
    "NonFiniteInputError",
    "RankFailure",
]


class FacenetError(Exception):
    """A problem with the input or the environment, reported to the user in one line.

    ``checkpoint_note`` (set by the run when it wrote a checkpoint before the error
    propagated) says where the state at the last finished step is. ``agreed`` is True when
    every rank of a multi-process run raises it at the same point (rank 0 alone reports it).
    """

    checkpoint_note: str | None = None
    agreed: bool = False


class ConfigError(FacenetError, ValueError):
    """A configuration key, value or combination that cannot be used; the message names it."""


class DataError(FacenetError, ValueError):
    """Images, folders or pairs files that cannot be used; the message names the file."""


class CheckpointError(FacenetError, RuntimeError):
    """A checkpoint could not be written, or was refused on loading."""


class WeightsError(FacenetError, ValueError):
    """A weights file that cannot be loaded into the model (refused, damaged or mismatched)."""


class NonFiniteLossError(FacenetError, RuntimeError):
    """Too many steps in a row had a non-finite loss; the run stops (exit code 3)."""


class NonFiniteInputError(DataError):
    """Input images holding NaN or infinite values (after the transform).

    Args:
        message: what happened.
        rows: the batch rows of the offending images, when known.
    """

    def __init__(self, message: str, rows: list[int] | None = None):
        super().__init__(message)
        self.rows = list(rows or [])


class RankFailure(FacenetError):
    """Another rank stopped with an error; this rank stops at the same point.

    Args:
        message: the other rank's message (``rank N: ...``).
        checkpointable: every rank stands at a finished step and may checkpoint together
            (False when the other rank's error is a bug: it is leaving without a checkpoint).
    """

    def __init__(self, message: str, checkpointable: bool = True):
        super().__init__(message)
        self.checkpointable = checkpointable
        self.agreed = True
