"""The run directory: one training process at a time (an flock the kernel releases when the
holder ends in any way), --overwrite clears what the previous run wrote."""

import multiprocessing
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from facenet.checkpoint import save_checkpoint
from facenet.errors import FacenetError
from facenet.training.run_dir import (
    LEGACY_RUN_OUTPUTS,
    OUTPUTS_RECORD,
    NotARunOutput,
    RunDirLock,
    RunDirLocked,
    RunOutputs,
    clear_previous_outputs,
)

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


@pytest.mark.parametrize("content", ["{pid}\n{host}\n", "1\nother-host\n", ""])
def test_a_lock_file_nobody_holds_is_taken(tmp_path, content):
    (tmp_path / ".lock").write_text(content.format(pid=os.getpid(), host=socket.gethostname()))
    with RunDirLock(tmp_path):
        text = (tmp_path / ".lock").read_text()
        assert text.split("\n")[:2] == [str(os.getpid()), socket.gethostname()]
    assert (tmp_path / ".lock").exists()  # removed only by the run that created it


@pytest.mark.parametrize(
    "content", ["garbage", "my notes\n", "1\nhost\nmore\n", "12\n" + "h" * 300 + "\n"]
)
def test_a_lock_file_no_run_wrote_is_refused_and_left_as_it_was(tmp_path, content):
    (tmp_path / ".lock").write_text(content)
    with pytest.raises(
        NotARunOutput, match=rf"{tmp_path / '.lock'} exists and is not a run's lock"
    ):
        RunDirLock(tmp_path).acquire()
    assert (tmp_path / ".lock").read_text() == content


@pytest.mark.parametrize("kind", ["link", "dangling link", "folder", "fifo"])
def test_a_lock_entry_that_is_no_regular_file_is_refused_and_never_followed(tmp_path, kind):
    target, lock = tmp_path / "target.txt", tmp_path / "run" / ".lock"
    lock.parent.mkdir()
    target.write_text("1\nhost\n")  # even a lock's content is not written through a link
    if kind == "link":
        lock.symlink_to(target)
    elif kind == "dangling link":
        lock.symlink_to(tmp_path / "missing")
    elif kind == "folder":
        lock.mkdir()
    else:
        os.mkfifo(lock)
    with pytest.raises(NotARunOutput, match="is not a run's lock file"):
        RunDirLock(lock.parent).acquire()
    assert target.read_text() == "1\nhost\n" and not (tmp_path / "missing").exists()
    assert lock.is_symlink() or lock.exists()


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


OUTPUT_LIKE = (
    "last.pt",
    "best.pt",
    "nonfinite.pt",
    "metrics.jsonl",
    "summary.json",
    "roc_val_epoch_1.png",
    "roc_test.png",
    "heldout.json",
    "holdout.json",
    "val_pairs.txt",
    "test_pairs.txt",
    "config.yaml",
)


def _fill(folder: Path, names=OUTPUT_LIKE) -> None:
    """Files (and a tensorboard/ tree) with every name a run writes."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        (folder / name).write_text("mine")
    (folder / "tensorboard").mkdir(exist_ok=True)
    (folder / "tensorboard" / "events.out.tfevents.1.host").write_text("mine")


def _record(folder: Path, *names: str) -> None:
    outputs = RunOutputs(folder)
    outputs.names = list(names)  # as a run that wrote them leaves its record
    outputs._save()


def test_a_folder_that_never_held_a_run_loses_nothing(tmp_path):
    _fill(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    assert clear_previous_outputs(tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert (tmp_path / "tensorboard" / "events.out.tfevents.1.host").read_text() == "mine"


def test_only_what_the_record_names_is_removed_with_the_record(tmp_path):
    _fill(tmp_path)
    (tmp_path / "data").mkdir()
    _record(tmp_path, "last.pt", "metrics.jsonl", "tensorboard", "roc_*.png")
    removed = clear_previous_outputs(tmp_path)
    assert sorted(p.name for p in removed) == [
        "last.pt",
        "metrics.jsonl",
        "roc_test.png",
        "roc_val_epoch_1.png",
        "tensorboard",
    ]
    left = sorted(p.name for p in tmp_path.iterdir())
    assert OUTPUTS_RECORD not in left and "data" in left
    assert {"best.pt", "summary.json", "test_pairs.txt", "config.yaml"} <= set(left)


def test_paths_the_configuration_reads_are_kept(tmp_path):
    _fill(tmp_path)
    _record(tmp_path, "test_pairs.txt", "tensorboard", "summary.json")
    inside = (
        tmp_path / "tensorboard" / "events.out.tfevents.1.host"
    )  # a folder holding a read file stays too
    removed = clear_previous_outputs(tmp_path, keep=[tmp_path / "test_pairs.txt", inside])
    assert [p.name for p in removed] == ["summary.json"]
    assert (tmp_path / "test_pairs.txt").exists() and inside.exists()


def test_names_leading_out_of_the_run_directory_are_not_followed(tmp_path):
    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    _fill(elsewhere)
    run.mkdir()
    (run / "tensorboard").symlink_to(elsewhere / "tensorboard")
    (run / "best.pt").symlink_to(elsewhere / "best.pt")
    _record(run, "../elsewhere/last.pt", str(elsewhere / "summary.json"), "tensorboard", "best.pt")
    removed = clear_previous_outputs(run)
    assert sorted(p.name for p in removed) == ["best.pt", "tensorboard"]  # the links only
    assert not (run / "tensorboard").is_symlink() and not (run / "best.pt").is_symlink()
    assert sorted(p.name for p in elsewhere.iterdir()) == sorted([*OUTPUT_LIKE, "tensorboard"])
    assert (elsewhere / "tensorboard" / "events.out.tfevents.1.host").exists()


def test_a_run_from_before_records_is_recognised_by_its_checkpoint(tmp_path):
    _fill(tmp_path)
    (tmp_path / "last.pt").unlink()
    save_checkpoint({"model": {}, "config": {}}, tmp_path / "last.pt")
    removed = {p.name for p in clear_previous_outputs(tmp_path)}
    assert removed == (set(LEGACY_RUN_OUTPUTS) - {"roc_*.png"}) | {
        "roc_test.png",
        "roc_val_epoch_1.png",
    }
    assert not (tmp_path / "config.yaml").exists()


def test_overwrite_of_a_run_from_before_records_takes_its_config_yaml_too(tmp_path):
    """A run directory written before outputs.json existed: its config.yaml is the run's."""
    (tmp_path / "config.yaml").write_text("old")
    save_checkpoint({"model": {}, "config": {}}, tmp_path / "last.pt")
    outputs = RunOutputs(tmp_path, clear_previous=True)
    outputs.add(tmp_path / "config.yaml")  # not refused as a file of the user's
    assert not (tmp_path / "config.yaml").exists() and not (tmp_path / "last.pt").exists()
    resumed = RunOutputs(tmp_path / "other")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.yaml").write_text("old")
    save_checkpoint({"model": {}, "config": {}}, tmp_path / "other" / "last.pt")
    resumed.add(tmp_path / "other" / "config.yaml")  # a resumed legacy run rewrites it
    assert resumed.names[:2] == ["last.pt", "config.yaml"]


def test_run_outputs_clear_at_the_first_write_and_refuse_foreign_files(tmp_path):
    _fill(tmp_path, names=("last.pt", "summary.json"))
    _record(tmp_path, "last.pt")
    outputs = RunOutputs(tmp_path, clear_previous=True)
    assert (tmp_path / "last.pt").exists()  # nothing removed before the run writes
    outputs.add(tmp_path / "last.pt")
    assert not (tmp_path / "last.pt").exists() and outputs.removed == [tmp_path / "last.pt"]
    with pytest.raises(NotARunOutput, match="summary.json exists and no run recorded"):
        outputs.add(tmp_path / "summary.json")
    assert (tmp_path / "summary.json").read_text() == "mine"
    outputs.add(tmp_path / "roc_*.png")
    resumed = RunOutputs(tmp_path)  # a resumed run continues the record
    resumed.add(tmp_path / "metrics.jsonl")
    assert resumed.names == ["last.pt", "roc_*.png", "metrics.jsonl"]


def test_run_outputs_of_other_ranks_write_nothing(tmp_path):
    RunOutputs(tmp_path, enabled=False).add(tmp_path / "last.pt")
    assert not (tmp_path / OUTPUTS_RECORD).exists()


FORK_AND_DIE = (
    "import os, signal, time\n"
    "from facenet.training.run_dir import RunDirLock\n"
    "lock = RunDirLock({path!r}); lock.acquire()\n"
    "if os.fork() == 0:  # a DataLoader worker outliving its run (off the test's pipes)\n"
    "    null = os.open(os.devnull, os.O_RDWR); os.dup2(null, 1); os.dup2(null, 2)\n"
    "    time.sleep(30); os._exit(0)\n"
    "print('held', flush=True)\n"
    "os.kill(os.getpid(), signal.SIGKILL)\n"
)


def test_a_forked_child_outliving_a_killed_run_does_not_keep_the_lock(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", FORK_AND_DIE.format(path=str(tmp_path))],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == -9 and "held" in proc.stdout
    started = time.monotonic()
    with RunDirLock(tmp_path):  # the child's copy of the descriptor was closed at the fork
        pass
    assert time.monotonic() - started < 20  # not after the child's 30 s


def test_a_recorded_roc_pattern_removes_only_the_figures_runs_write(tmp_path):
    _fill(tmp_path, names=("roc_test.png", "roc_val_epoch_12.png", "roc_mine.png", "roc_.png"))
    _record(tmp_path, "roc_*.png")  # as records written before exact names were kept
    removed = sorted(p.name for p in clear_previous_outputs(tmp_path))
    assert removed == ["roc_test.png", "roc_val_epoch_12.png"]
    assert (tmp_path / "roc_mine.png").exists() and (tmp_path / "roc_.png").exists()


@pytest.mark.parametrize("entry", ["dangling link", "link out", "folder"])
def test_a_planned_name_held_by_anything_unrecorded_is_refused_before_any_removal(tmp_path, entry):
    _fill(tmp_path, names=("last.pt",))
    _record(tmp_path, "last.pt")
    target = tmp_path / "summary.json"
    if entry == "dangling link":
        target.symlink_to(tmp_path / "nowhere")
    elif entry == "link out":
        target.symlink_to(tmp_path / "last.pt")
    else:
        target.mkdir()
    outputs = RunOutputs(tmp_path, clear_previous=True)
    with pytest.raises(NotARunOutput, match="summary.json exists"):
        outputs.plan(["last.pt", "summary.json"])
    assert (tmp_path / "last.pt").exists() and (tmp_path / OUTPUTS_RECORD).exists()


def test_a_planned_name_the_configuration_reads_is_refused_even_inside_a_folder(tmp_path):
    _fill(tmp_path)
    _record(tmp_path, "tensorboard", "best.pt", "summary.json")
    reads = {
        "tensorboard": tmp_path / "tensorboard" / "events.out.tfevents.1.host",
        "best.pt": tmp_path / "best.pt",
    }
    for name, read in reads.items():
        outputs = RunOutputs(tmp_path, clear_previous=True, keep=[read])
        with pytest.raises(NotARunOutput, match="configuration reads"):
            outputs.plan([name])
        assert read.exists()
    outputs = RunOutputs(tmp_path, clear_previous=True, keep=[tmp_path / "tensorboard" / "x"])
    outputs.plan(["best.pt", "best.pt"])  # planned twice, recorded once
    outputs.add(tmp_path / "summary.json")
    assert outputs.names == ["best.pt", "summary.json"] and not (tmp_path / "best.pt").exists()


def test_an_outputs_record_that_is_a_fifo_is_no_record(tmp_path):
    os.mkfifo(tmp_path / OUTPUTS_RECORD)  # reading it would wait for a writer
    (tmp_path / "last.pt").write_text("mine")  # not a checkpoint: nothing to remove
    assert clear_previous_outputs(tmp_path) == [] and (tmp_path / "last.pt").exists()


@pytest.mark.parametrize("entry", ["my_notes.txt", "sub/my_notes.txt", "link", "fifo"])
def test_a_recorded_folder_holding_what_no_run_wrote_refuses_removing_nothing(tmp_path, entry):
    _fill(tmp_path)
    (tmp_path / "tensorboard" / "old").mkdir()
    (tmp_path / "tensorboard" / "old" / "events.out.tfevents.2.host").write_text("run's")
    foreign = tmp_path / "tensorboard" / entry
    foreign.parent.mkdir(exist_ok=True)
    if entry == "link":
        foreign.symlink_to(tmp_path / "best.pt")
    elif entry == "fifo":
        os.mkfifo(tmp_path / "tensorboard" / "events.out.tfevents.3.host")
        foreign = tmp_path / "tensorboard" / "events.out.tfevents.3.host"
    else:
        foreign.write_text("mine")
    _record(tmp_path, "last.pt", "tensorboard")
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    with pytest.raises(NotARunOutput, match=rf"{foreign} is in {tmp_path / 'tensorboard'}"):
        clear_previous_outputs(tmp_path)
    outputs = RunOutputs(tmp_path, clear_previous=True)
    with pytest.raises(NotARunOutput, match="which --overwrite removes"):
        outputs.plan(["last.pt"])
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before
    if entry != "fifo":
        os.unlink(foreign)
        assert [p.name for p in clear_previous_outputs(tmp_path)] == ["last.pt", "tensorboard"]
