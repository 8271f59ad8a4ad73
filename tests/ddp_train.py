"""``facenet-train`` under torchrun, with an optional fault on one rank (for the tests).

``FACENET_TEST_FAULT=<rank>:<n>:<kind>``: on that rank, ``sigterm`` sends SIGTERM to the
worker itself after its n-th step; ``crash`` makes its n-th step raise MemoryError (an
out-of-memory inside the step); ``corrupt`` makes its n-th image fetch raise
CorruptImageError, as a damaged file found in training would.
"""

import os
import signal
import sys

import facenet.data.loading
import facenet.training.engine
from facenet.cli import train
from facenet.data.images import CorruptImageError


def after_nth_call(cls, name: str, n: int, action) -> None:
    """Wrap ``cls.name`` so that ``action`` runs around its n-th call."""
    original, calls = getattr(cls, name), [0]

    def wrapped(self, *args, **kwargs):
        calls[0] += 1
        return action(calls[0] == n, lambda: original(self, *args, **kwargs))

    setattr(cls, name, wrapped)


def sigterm_after(hit, call):
    out = call()
    if hit:
        os.kill(os.getpid(), signal.SIGTERM)
    return out


def crash_at(hit, call):
    if hit:
        raise MemoryError("injected: out of memory in this rank's step")
    return call()


def install_fault(spec: str) -> None:
    rank, n, kind = spec.split(":")
    if int(os.environ.get("RANK", 0)) != int(rank):
        return
    if kind == "sigterm":
        after_nth_call(facenet.training.engine.Trainer, "train_step", int(n), sigterm_after)
    elif kind == "crash":
        after_nth_call(facenet.training.engine.Trainer, "train_step", int(n), crash_at)
    elif kind == "corrupt":
        corrupt_nth_image(facenet.data.loading.SeededSamples, int(n))


def corrupt_nth_image(cls, n: int) -> None:
    """The loader fetches a batch's images at once (``__getitems__``): the batch holding the
    n-th image fetched raises CorruptImageError."""
    original, fetched = cls.__getitems__, [0]

    def wrapped(self, items):
        fetched[0] += len(items)
        if fetched[0] - len(items) < n <= fetched[0]:
            raise CorruptImageError("faces/injected.png", "damaged (injected on this rank)")
        return original(self, items)

    cls.__getitems__ = wrapped


if __name__ == "__main__":
    if os.environ.get("FACENET_TEST_FAULT"):
        install_fault(os.environ["FACENET_TEST_FAULT"])
    sys.exit(train.main(sys.argv[1:]))
