"""glibc's malloc set up for tensor work; every command does it at start, the library never.

glibc serves each block over its mmap threshold (128 KiB, raised as blocks are freed to at most
32 MiB) from a mapping of its own and unmaps it on free. A forward frees and requests the same
activation buffers every batch (Inception-ResNet-v1 on 128 images at 160 px: buffers up to
190 MB, most over any threshold), and the kernel faults each page back in, zeroed: 40% of an LFW
evaluation's CPU time went to the kernel. With no block mapped on its own, freed buffers stay
in the heap and are reused; its free top goes back to the kernel past ``TRIM_THRESHOLD``, which
bounds what the process holds beyond its live memory. BENCHMARKS.md ("CPU: the kernel's share")
has the measured cost: 1.7-1.9x faster forwards for 1.06-1.27x the peak RSS.

``FACENET_MALLOC=system`` (or a glibc ``MALLOC_*_`` / ``GLIBC_TUNABLES`` setting of one's own)
leaves malloc as the platform set it. Elsewhere than on glibc (macOS, Windows, musl) there is
no such control and nothing is changed.
"""

from __future__ import annotations

import ctypes
import os
import warnings

ENV = "FACENET_MALLOC"
CHOICES = ("keep", "system")  # keep freed memory in the heap (default); the platform's own
# glibc's own environment settings: one of them means the user chose for themselves
_USER_SETTINGS = ("GLIBC_TUNABLES", "MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_")
_USER_SETTINGS += ("MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")
# mallopt's parameters (glibc's malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4
MMAP_MAX_DEFAULT = 65536
# Free heap top kept before it is returned: above one forward's buffers, which are then
# never faulted in again (256 MiB still left 6% of the forward's CPU to the kernel).
TRIM_THRESHOLD = 1 << 30
_keeping = False  # whether keep_freed_memory set this process's malloc up


def _has_glibc() -> bool:
    try:  # no confstr on Windows; no such name on macOS; EINVAL from musl
        return bool(os.confstr("CS_GNU_LIBC_VERSION"))
    except (AttributeError, ValueError, OSError):
        return False


def glibc_call(name: str, *args) -> int | None:
    """glibc's function ``name`` called with ``args``; None where there is no glibc."""
    return getattr(ctypes.CDLL(None), name)(*args) if _has_glibc() else None


def keep_freed_memory() -> bool:
    """Set glibc's malloc to keep freed blocks in its heap (no block mapped on its own, heap
    top returned past ``TRIM_THRESHOLD``) unless ``FACENET_MALLOC`` or the user's own glibc
    settings say otherwise; whether it was set. Process-wide, and inherited by forked workers.
    """
    choice = os.environ.get(ENV, "keep")
    if choice not in CHOICES:
        warnings.warn(
            f"{ENV}={choice!r} is not one of {CHOICES}: malloc left as it is", stacklevel=2
        )
    if choice != "keep" or any(name in os.environ for name in _USER_SETTINGS):
        return False
    global _keeping
    settings = {M_MMAP_MAX: 0, M_TRIM_THRESHOLD: TRIM_THRESHOLD}
    _keeping = all(glibc_call("mallopt", key, value) for key, value in settings.items())
    return _keeping


def keeps_freed_memory() -> bool:
    """Whether :func:`keep_freed_memory` set this process's malloc up (a forked child's too)."""
    return _keeping
