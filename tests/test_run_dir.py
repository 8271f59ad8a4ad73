"""The run directory: one training process at a time, stale locks taken over, --overwrite
clears what the previous run wrote."""

import os
import socket
import subprocess
import sys

import pytest

from facenet.errors import FacenetError
from facenet.run_dir import RunDirLock, RunDirLocked, clear_previous_outputs


def dead_pid() -> int:
    proc = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(proc.stdout)


def test_a_second_lock_is_refused_naming_the_directory_and_the_pid(tmp_path):
    with RunDirLock(tmp_path):
        other = RunDirLock(tmp_path)
        other._stale = lambda: False  # the same process: stands for a second live one
        with pytest.raises(RunDirLocked, match=rf"{tmp_path} is in use by process {os.getpid()}"):
            other.acquire()
    assert not (tmp_path / ".lock").exists()  # released
    assert issubclass(RunDirLocked, FacenetError)


def test_a_live_process_holding_the_lock_is_respected(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / ".lock").write_text(f"{sleeper.pid}\n{socket.gethostname()}\n")
        with pytest.raises(RunDirLocked, match=f"process {sleeper.pid}"):
            RunDirLock(tmp_path).acquire()
    finally:
        sleeper.kill()
        sleeper.wait()


@pytest.mark.parametrize("content", ["{pid}\n{host}\n", "garbage", ""])
def test_a_stale_or_damaged_lock_is_taken_over(tmp_path, content):
    lock = tmp_path / ".lock"
    lock.write_text(content.format(pid=dead_pid(), host=socket.gethostname()))
    with RunDirLock(tmp_path):
        assert lock.read_text().split("\n")[:2] == [str(os.getpid()), socket.gethostname()]
    assert not lock.exists()
    assert [p.name for p in tmp_path.iterdir()] == []  # no stale copy left behind


def test_clear_previous_outputs_keeps_config_and_data(tmp_path):
    for name in (
        "last.pt",
        "best.pt",
        "metrics.jsonl",
        "summary.json",
        "roc_val_epoch_1.png",
        "roc_test.png",
        "config.yaml",
    ):
        (tmp_path / name).write_text("x")
    (tmp_path / "tensorboard").mkdir()
    (tmp_path / "tensorboard" / "events.out").write_text("x")
    (tmp_path / "data").mkdir()
    removed = clear_previous_outputs(tmp_path)
    assert len(removed) == 7
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml", "data"]
