"""The run directory: one training process at a time (an flock the kernel releases when the
holder ends in any way), --overwrite clears what the previous run wrote."""

import multiprocessing
import os
import socket
import subprocess
import sys

import pytest

from facenet.errors import FacenetError
from facenet.training.run_dir import RunDirLock, RunDirLocked, clear_previous_outputs

HOLD = (
    "import time\n"
    "from facenet.training.run_dir import RunDirLock\n"
    "lock = RunDirLock({path!r}); lock.acquire(); print('held', flush=True); time.sleep(60)\n"
)


def test_a_second_lock_is_refused_naming_the_directory_and_the_pid(tmp_path):
    with RunDirLock(tmp_path):
        with pytest.raises(RunDirLocked, match=rf"{tmp_path} is in use by process {os.getpid()}"):
            RunDirLock(tmp_path).acquire()
    assert not (tmp_path / ".lock").exists()  # released
    assert issubclass(RunDirLocked, FacenetError)
    with RunDirLock(tmp_path):  # free again
        pass


def test_another_live_process_holding_the_lock_is_respected_until_it_dies(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD.format(path=str(tmp_path))],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunDirLocked, match=f"process {holder.pid}"):
            RunDirLock(tmp_path).acquire()
    finally:
        holder.kill()  # kill -9: no clean-up code runs
        holder.wait()
    with RunDirLock(tmp_path):  # the kernel released it with the process
        pass


@pytest.mark.parametrize("content", ["{pid}\n{host}\n", "1\nother-host\n", "garbage", ""])
def test_a_lock_file_nobody_holds_is_taken(tmp_path, content):
    (tmp_path / ".lock").write_text(content.format(pid=os.getpid(), host=socket.gethostname()))
    with RunDirLock(tmp_path):
        text = (tmp_path / ".lock").read_text()
        assert text.split("\n")[:2] == [str(os.getpid()), socket.gethostname()]


def _contend(path, barrier, results):
    barrier.wait()
    try:
        lock = RunDirLock(path)
        lock.acquire()
        results.put("held")
        barrier.wait()  # hold it until every contender has tried
        lock.release()
    except RunDirLocked:
        results.put("refused")
        barrier.wait()


def test_of_runs_started_together_exactly_one_holds_the_lock(tmp_path):
    context = multiprocessing.get_context("fork")
    for trial in range(10):
        path = tmp_path / f"t{trial}"
        path.mkdir()
        barrier, results = context.Barrier(3), context.Queue()
        procs = [context.Process(target=_contend, args=(path, barrier, results)) for _ in range(3)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(timeout=30)
        outcomes = sorted(results.get(timeout=5) for _ in procs)
        assert outcomes == ["held", "refused", "refused"], (trial, outcomes)


def test_clear_previous_outputs_keeps_config_and_data(tmp_path):
    for name in (
        "last.pt",
        "best.pt",
        "metrics.jsonl",
        "summary.json",
        "roc_val_epoch_1.png",
        "roc_test.png",
        "holdout.json",
        "config.yaml",
    ):
        (tmp_path / name).write_text("x")
    (tmp_path / "tensorboard").mkdir()
    (tmp_path / "tensorboard" / "events.out").write_text("x")
    (tmp_path / "data").mkdir()
    removed = clear_previous_outputs(tmp_path)
    assert len(removed) == 8
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml", "data"]
