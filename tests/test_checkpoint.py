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
    """Why legacy files are scanned here: torch's static check needs a zip archive."""
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
    with pytest.raises(CheckpointError, match="none.pt: No such file"):
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


# --------------------------------------------------------------------------- hostile files


def _patched_legacy(tmp_path, elements=70_000, declared=2**31 - 1):
    """A legacy-format file whose storage declares ``declared`` elements (8 GiB of floats)
    where it holds ``elements``: the old loader allocates the declared size first."""
    path = tmp_path / "declared.pt"
    _legacy_save({"w": torch.ones(elements)}, path)
    data = path.read_bytes()
    old = b"J" + elements.to_bytes(4, "little")  # BININT: the storage's, then the shape's
    assert data.count(old) == 2
    path.write_bytes(data.replace(old, b"J" + declared.to_bytes(4, "little"), 1))
    return path


def test_a_legacy_storage_declared_beyond_the_file_is_refused_before_loading(tmp_path, monkeypatch):
    path = _patched_legacy(tmp_path)
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load was reached"))
    with pytest.raises(CheckpointError, match=r"declared.pt: its tensors declare 2147483647 "):
        load_checkpoint(path)
    monkeypatch.undo()
    assert load_checkpoint(_patched_legacy(tmp_path, declared=70_000))["w"].shape == (70_000,)


@pytest.mark.parametrize(
    "tensor",
    [
        torch.zeros(1).expand(2**40),  # stride 0: 4 TiB of floats over one element
        torch.zeros(4, 1).expand(4, 2**38),
        torch.sparse_coo_tensor(torch.zeros(2, 1, dtype=torch.long), [1.0], (2**30, 2**30)),
    ],
    ids=["expanded", "expanded 2-d", "sparse"],
)
@pytest.mark.parametrize("write", [torch.save, _legacy_save], ids=["zip", "legacy"])
def test_a_tensor_larger_than_its_file_is_refused_before_it_materialises(tmp_path, tensor, write):
    path = tmp_path / "crafted.pt"
    write({"model": {"w": tensor}, "epoch": 1}, path)
    with pytest.raises(CheckpointError, match=r"crafted.pt: a torch.(strided|sparse_coo) tensor"):
        load_checkpoint(path)


def test_every_cut_through_a_legacy_file_is_one_error(tmp_path):
    path = tmp_path / "068.ckpt"
    _legacy_save({"epoch": 68, "net_state_dict": torch.nn.Linear(30, 20).state_dict()}, path)
    data = path.read_bytes()
    for cut in [*range(0, len(data), 13), len(data) - 1]:
        path.write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match="cannot read checkpoint"):
            load_checkpoint(path)


def test_only_regular_files_of_bounded_size_are_read(tmp_path):
    fifo = tmp_path / "last.pt"
    os.mkfifo(fifo)
    for other in (fifo, "/dev/zero", tmp_path):
        with pytest.raises(CheckpointError, match="not a regular file"):
            load_checkpoint(other)
    huge = tmp_path / "huge.pt"
    with open(huge, "wb") as fh:
        fh.truncate(16 * 2**30 + 1)  # sparse: the size is declared, never written
    with pytest.raises(CheckpointError, match="huge.pt: 17179869185 bytes is larger"):
        load_checkpoint(huge)


def test_shared_and_nested_contents_are_checked_once_each(tmp_path):
    shared = [torch.ones(3)] * 1000
    contents = {"a": [shared] * 1000, "b": [[[[shared]]]]}
    torch.save(contents, tmp_path / "shared.pt")
    assert len(load_checkpoint(tmp_path / "shared.pt")["a"]) == 1000


class _StandInCuda:
    """torch.cuda's generator functions for a machine with ``count`` devices, device ``current``
    set (as set_device does per rank): each device's state a distinct tensor."""

    def __init__(self, count: int, current: int):
        self.states = {i: torch.full((4,), i, dtype=torch.uint8) for i in range(count)}
        self.current, self.count = current, count

    def install(self, monkeypatch):
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "is_available", lambda: True)
        monkeypatch.setattr(cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(cuda, "get_rng_state", lambda: self.states[self.current].clone())
        monkeypatch.setattr(
            cuda, "set_rng_state", lambda s: self.states.__setitem__(self.current, s.clone())
        )
        monkeypatch.setattr(cuda, "get_rng_state_all", lambda: list(self.states.values()))


def test_each_rank_saves_and_restores_its_own_device_generator(monkeypatch, tmp_path):
    saver = _StandInCuda(count=4, current=2)  # rank 2 of 4 GPUs
    saver.install(monkeypatch)
    state = rng_state()
    assert torch.equal(state["cuda"], saver.states[2])  # its own device's, not all four
    save_checkpoint({"rng": state}, tmp_path / "rng.pt")
    resumer = _StandInCuda(count=1, current=0)  # resumed on a machine with one visible GPU
    resumer.install(monkeypatch)
    set_rng_state(load_checkpoint(tmp_path / "rng.pt")["rng"])
    assert torch.equal(resumer.states[0], torch.full((4,), 2, dtype=torch.uint8))


def test_an_older_checkpoint_with_every_device_resumes_on_fewer_devices(monkeypatch):
    older = {**rng_state(), "cuda": [torch.full((4,), i, dtype=torch.uint8) for i in range(4)]}
    for current, expected in ((1, 1), (0, 0)):
        stand_in = _StandInCuda(count=2, current=current)
        stand_in.install(monkeypatch)
        set_rng_state(older)  # no IndexError: this device's entry is restored
        assert torch.equal(stand_in.states[current], torch.full((4,), expected, dtype=torch.uint8))
    beyond = _StandInCuda(count=8, current=6)  # more devices now than saved: left as it was
    beyond.install(monkeypatch)
    set_rng_state(older)
    assert torch.equal(beyond.states[6], torch.full((4,), 6, dtype=torch.uint8))


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_the_file_checked_is_the_file_loaded(tmp_path, monkeypatch, legacy):
    """A file put in the checked file's name between the checks and the load is not loaded."""
    import facenet.checkpoint as checkpoint

    path, other = tmp_path / "model.pt", tmp_path / "other.pt"
    torch.save({"which": torch.tensor(1)}, path, _use_new_zipfile_serialization=not legacy)
    torch.save({"which": torch.tensor(2)}, other, _use_new_zipfile_serialization=not legacy)
    declared = checkpoint._declared_bytes

    def swap_then_check(fh, zipped, names):
        os.replace(other, path)  # the name now holds another file; the descriptor does not
        return declared(fh, zipped, names)

    monkeypatch.setattr(checkpoint, "_declared_bytes", swap_then_check)
    assert load_weights_only(path)["which"].item() == 1
    assert torch.load(path, weights_only=True)["which"].item() == 2  # the swap happened
