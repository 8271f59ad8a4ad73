"""glibc's malloc set up by the commands (facenet.memory), never by importing the library."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from facenet import memory as allocator
from facenet.cli import common
from facenet.wings.align import aligner as align_module

ROOT = Path(__file__).resolve().parents[1]
glibc_only = pytest.mark.skipif(
    allocator.glibc_call("gnu_get_libc_version") is None, reason="glibc's mallopt only"
)

# Minor page faults of filling 64 MB 4 times, each freed at once, after importing the library,
# then again inside a command's start-up block. In the heap the same request only settles after
# a few rounds (torch's 64-byte aligned requests do not fit a freed block whose neighbours small
# objects took): the first 12 rounds are not counted.
FAULTS_SCRIPT = textwrap.dedent(
    """
    import resource
    import torch
    import facenet.evaluation.embedding, facenet.training.loop, facenet.wings.align.aligner
    from facenet.cli.common import one_line_warnings

    def refill_faults():
        for _ in range(12):
            torch.ones(1 << 24)  # 64 MB, freed at once
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(4):
            torch.ones(1 << 24)
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    imported = refill_faults()
    with one_line_warnings():
        print(imported, refill_faults())
    """
)


def _faults(env_extra: dict) -> tuple[int, int]:
    chosen = allocator._USER_SETTINGS + (allocator.ENV,)
    env = {k: v for k, v in os.environ.items() if k not in chosen}
    env.update(env_extra, PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, "-c", FAULTS_SCRIPT], env=env, capture_output=True, text=True, check=True
    )
    imported, in_command = map(int, done.stdout.split())
    return imported, in_command


@glibc_only
def test_a_command_keeps_freed_memory_and_importing_the_library_does_not():
    imported, in_command = _faults({})
    pages = 4 * (64 << 20) // os.sysconf("SC_PAGE_SIZE")
    assert imported >= pages // 2  # a fresh mapping each time, faulted in page by page
    assert in_command < pages // 20  # the freed heap block, reused


@glibc_only
def test_facenet_malloc_system_leaves_malloc_as_it_is():
    imported, in_command = _faults({allocator.ENV: "system"})
    pages = 4 * (64 << 20) // os.sysconf("SC_PAGE_SIZE")
    assert min(imported, in_command) >= pages // 2


def _mallopt_calls(monkeypatch) -> list:
    calls = []
    monkeypatch.setattr(allocator, "glibc_call", lambda *args: calls.append(args) or 1)
    for name in allocator._USER_SETTINGS + (allocator.ENV,):
        monkeypatch.delenv(name, raising=False)
    return calls


def test_keep_freed_memory_sets_no_mapped_blocks_and_the_trim_threshold(monkeypatch):
    calls = _mallopt_calls(monkeypatch)
    assert allocator.keep_freed_memory()
    assert calls == [
        ("mallopt", allocator.M_MMAP_MAX, 0),
        ("mallopt", allocator.M_TRIM_THRESHOLD, allocator.TRIM_THRESHOLD),
    ]


@pytest.mark.parametrize(
    "name, value", [("FACENET_MALLOC", "system"), ("MALLOC_MMAP_THRESHOLD_", "1000000")]
)
def test_an_explicit_choice_leaves_malloc_alone(monkeypatch, name, value):
    calls = _mallopt_calls(monkeypatch)
    monkeypatch.setenv(name, value)
    assert not allocator.keep_freed_memory()
    assert calls == []


def test_an_unknown_choice_is_one_warning_line_naming_it(monkeypatch, capsys):
    calls = _mallopt_calls(monkeypatch)
    monkeypatch.setenv(allocator.ENV, "jemalloc")
    with common.one_line_warnings():
        pass
    err = capsys.readouterr().err
    assert err.startswith("warning: FACENET_MALLOC='jemalloc' is not one of")
    assert err.count("\n") == 1 and calls == []


def test_no_glibc_changes_nothing(monkeypatch):
    monkeypatch.setattr(allocator, "_has_glibc", lambda: False)
    assert allocator.glibc_call("mallopt", allocator.M_MMAP_MAX, 0) is None


@pytest.mark.parametrize("keeping, trims", [(True, 0), (False, 1)])
def test_the_aligner_trims_the_heap_only_where_malloc_does_not_keep_it(
    monkeypatch, tmp_path, keeping, trims
):
    calls = []
    monkeypatch.setattr(allocator, "_keeping", keeping)
    monkeypatch.setattr(align_module, "glibc_call", lambda *args: calls.append(args[0]))
    photo = tmp_path / "a.png"
    Image.fromarray(np.zeros((40, 40, 3), np.uint8)).save(photo)
    settings = align_module.AlignSettings.from_preset("sandberg")
    align_module.Aligner(settings).detect_files([str(photo)])
    assert calls.count("malloc_trim") == trims
