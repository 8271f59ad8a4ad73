"""Checkpoints: atomic writes, weights_only loading, crafted pickles refused, RNG round trip."""

import errno
import os
import pickle
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

from facenet.checkpoint import (
    load_checkpoint,
    load_weights_only,
    remove_stale_temporary_files,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from facenet.errors import CheckpointError


def test_round_trip_of_plain_contents(tmp_path):
    model = torch.nn.Linear(3, 2)
    state = {"model": model.state_dict(), "epoch": 4, "config": {"train": {"lr": 0.1}}}
    save_checkpoint(state, tmp_path / "last.pt")
    loaded = load_checkpoint(tmp_path / "last.pt")
    assert loaded["epoch"] == 4 and loaded["config"] == {"train": {"lr": 0.1}}
    assert torch.equal(loaded["model"]["weight"], model.weight.detach())
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]


class Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_crafted_pickle_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "created_by_payload"
    path = tmp_path / "evil.pt"
    torch.save({"model": Payload(str(marker))}, path, pickle_protocol=2)
    assert not marker.exists()  # saving does not call the payload
    with pytest.raises(CheckpointError, match="refused"):
        load_checkpoint(path)
    assert not marker.exists()
    # The payload is live: plain unpickling runs it, so the assertions above can fail.
    pickle.loads(pickle.dumps(Payload(str(marker)))).close()
    assert marker.exists()


def _legacy_save(contents, path):
    """The pre-1.6 torch format (not a zip archive), as many published checkpoints are."""
    torch.save(contents, path, _use_new_zipfile_serialization=False)


def test_legacy_format_loads_with_weights_only(tmp_path):
    model = torch.nn.Linear(3, 2)
    path = tmp_path / "legacy.pt"
    _legacy_save({"model": model.state_dict(), "epoch": 4}, path)
    assert path.read_bytes()[:4] != b"PK\x03\x04"  # really the old format
    loaded = load_checkpoint(path)
    assert loaded["epoch"] == 4 and torch.equal(loaded["model"]["weight"], model.weight.detach())


def test_torch_lists_unsafe_globals_of_zip_files_only(tmp_path):
    """Why legacy files are read statically here: torch's static check needs a zip archive."""
    _legacy_save({"w": torch.ones(2)}, tmp_path / "legacy.pt")
    with pytest.raises(ValueError):
        torch.serialization.get_unsafe_globals_in_checkpoint(tmp_path / "legacy.pt")


@pytest.mark.parametrize(
    "write",
    [
        lambda obj, path: torch.save(obj, path),
        _legacy_save,
        lambda obj, path: path.write_bytes(pickle.dumps(obj, protocol=2)),
        lambda obj, path: path.write_bytes(pickle.dumps(obj, protocol=5)),
    ],
    ids=["zip", "legacy", "pickle protocol 2", "pickle protocol 5"],
)
def test_a_pickle_that_would_run_code_is_refused_by_name_in_any_format(tmp_path, write):
    marker, path = tmp_path / "created_by_payload", tmp_path / "evil.pt"
    write({"model": Payload(str(marker)), "w": torch.ones(2)}, path)
    with pytest.raises(CheckpointError, match="refused to load checkpoint .*evil.pt") as err:
        load_checkpoint(path)
    message = str(err.value)
    assert "unsupported GLOBAL" in message and "open" in message  # the payload's global
    assert "weights_only=False" not in message and "weights_only` set to" not in message
    assert not marker.exists()


def test_damaged_legacy_file_is_not_called_unsafe(tmp_path):
    path = tmp_path / "torn.pt"
    _legacy_save({"w": torch.ones(1000)}, path)
    path.write_bytes(path.read_bytes()[:60])
    with pytest.raises(CheckpointError, match="cannot read checkpoint .*torn.pt"):
        load_checkpoint(path)
    path.write_bytes(b"not a torch file at all")
    with pytest.raises(ValueError, match="cannot read weights file .*not a torch.save file"):
        load_weights_only(path, "weights file", ValueError)


def test_missing_and_truncated_files(tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        load_checkpoint(tmp_path / "none.pt")
    path = tmp_path / "torn.pt"
    save_checkpoint({"w": torch.ones(1000)}, path)
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="cannot read"):
        load_checkpoint(path)


def test_full_disk_leaves_previous_checkpoint_and_no_temp_file(tmp_path, monkeypatch):
    path = tmp_path / "last.pt"
    save_checkpoint({"epoch": 1}, path)

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", no_space)
    with pytest.raises(CheckpointError, match="No space left.*previous checkpoint is intact"):
        save_checkpoint({"epoch": 2}, path)
    monkeypatch.undo()
    assert load_checkpoint(path)["epoch"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]


def test_stale_temporary_files_of_dead_writers_are_removed(tmp_path):
    save_checkpoint({"epoch": 1}, tmp_path / "last.pt")
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    stale = tmp_path / f".last.pt.{int(dead.stdout)}.tmp"
    stale.write_bytes(b"torn")
    mine = tmp_path / f".last.pt.{os.getpid()}.tmp"
    mine.write_bytes(b"in progress")
    assert remove_stale_temporary_files(tmp_path) == [stale]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["last.pt", mine.name])


def test_unwritable_folder_names_the_path(tmp_path):
    target = tmp_path / "missing_dir" / "last.pt"
    with pytest.raises(CheckpointError, match="missing_dir"):
        save_checkpoint({"epoch": 1}, target)


def test_rng_state_round_trip_through_a_checkpoint(tmp_path):
    save_checkpoint({"rng": rng_state()}, tmp_path / "rng.pt")
    expected = (torch.rand(3), np.random.rand(3), random.random())
    set_rng_state(load_checkpoint(tmp_path / "rng.pt")["rng"])
    got = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(expected[0], got[0])
    assert np.array_equal(expected[1], got[1])
    assert expected[2] == got[2]
