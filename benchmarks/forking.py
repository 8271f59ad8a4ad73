"""Run one measurement in a forked child, so that its peak RSS and its failures are its own."""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path


def run_forked(fn, *args) -> dict:
    """``fn(*args)`` in a forked child; its JSON-able dict comes back through a pipe.

    A child that raises or dies (killed for memory) gives ``{"error": ...}``. The parent must
    not have initialised CUDA: each child starts its own context.
    """
    read_end, write_end = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # child
        os.close(read_end)
        try:
            text = json.dumps(fn(*args))
        except BaseException as err:  # reported to the parent, never raised past the fork
            last = traceback.extract_tb(err.__traceback__)[-1]
            where = f"{Path(last.filename).name}:{last.lineno}"
            text = json.dumps({"error": f"{type(err).__name__}: {str(err)[:300]} ({where})"})
        with os.fdopen(write_end, "w") as fh:
            fh.write(text)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as fh:
        text = fh.read()
    _, status = os.waitpid(pid, 0)
    if not text:
        return {"error": f"child died (wait status {status}), likely out of memory"}
    return json.loads(text)
