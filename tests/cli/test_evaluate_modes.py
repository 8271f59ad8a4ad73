"""facenet-evaluate's modes: one per call, chosen from the table ``MODES``, each option of a
mode refused in another (never silently ignored)."""

import pytest

from facenet.cli.evaluate import EMBEDDING, MODES, _parse
from facenet.errors import DataError

CHECKPOINT = ["--checkpoint", "model.pt"]
# the options naming what is evaluated, as a command line gives them
TARGETS = {
    "pairs": ["--pairs", "pairs.txt"],
    "bin": ["--bin", "lfw.bin"],
    "retrieval": ["--retrieval", "faces/"],
    "ijb": ["--ijb", "IJBC/"],
}
# one option of each mode that only that mode takes
OWN = {
    "distances": ["--similarities"],
    "pairs": ["--root", "lfw/"],
    "ijb": ["--no-flip-test"],
}


def test_each_mode_is_chosen_by_its_option():
    assert _parse(["--distances", "d.npz"]).mode == "distances"
    for name, option in TARGETS.items():
        assert _parse(CHECKPOINT + option).mode == name


@pytest.mark.parametrize("first", list(TARGETS))
@pytest.mark.parametrize("second", list(TARGETS))
def test_two_modes_at_once_are_refused(first, second):
    if first == second:
        return
    with pytest.raises(DataError, match="one evaluation at a time"):
        _parse(CHECKPOINT + TARGETS[first] + TARGETS[second])


@pytest.mark.parametrize("name", list(TARGETS))
def test_a_mode_that_embeds_goes_without_distances(name):
    with pytest.raises(DataError, match=f"--distances and --{name}: one evaluation at a time"):
        _parse(["--distances", "d.npz"] + TARGETS[name])


def test_a_checkpoint_alone_says_what_it_needs():
    with pytest.raises(DataError, match="--checkpoint needs --pairs, --bin, --retrieval or --ijb"):
        _parse(CHECKPOINT)


@pytest.mark.parametrize("owner", list(OWN))
@pytest.mark.parametrize("mode", ["distances", *TARGETS])
def test_an_option_of_another_mode_is_refused(owner, mode):
    line = ["--distances", "d.npz"] if mode == "distances" else CHECKPOINT + TARGETS[mode]
    if owner == mode:
        assert _parse(line + OWN[owner]).mode == mode
        return
    with pytest.raises(DataError, match=f"{OWN[owner][0]} goes with --{owner}"):
        _parse(line + OWN[owner])


# one way to give each option of EMBEDDING on a command line
EMBEDDING_OPTIONS = {
    "flip": ["--flip"],
    "preprocess": ["--preprocess", "crop"],
    "subtract_mean": ["--subtract-mean"],
    "features": ["--features", "raw"],
    "scoring": ["--scoring", "float64"],
    "batch_size": ["--batch-size", "7"],
    "device": ["--device", "cuda:7"],
}


@pytest.mark.parametrize("dest", EMBEDDING)
def test_an_embedding_option_is_refused_with_distances_and_taken_with_a_model(dest):
    option = EMBEDDING_OPTIONS[dest]
    with pytest.raises(DataError, match=f"{option[0]} goes with --checkpoint: --distances has no"):
        _parse(["--distances", "d.npz", *option])
    assert _parse(CHECKPOINT + TARGETS["pairs"] + option).mode == "pairs"


def test_pairs_from_a_config_give_way_to_a_mode_on_the_command_line(tmp_path):
    config = tmp_path / "eval.yaml"
    config.write_text("eval:\n  pairs: lfw/pairs.txt\n", encoding="utf-8")
    assert _parse(CHECKPOINT + ["--config", str(config)]).mode == "pairs"
    assert _parse(CHECKPOINT + ["--config", str(config), "--bin", "a.bin"]).mode == "bin"


def test_every_mode_option_is_an_option_of_the_command():
    from facenet.cli.evaluate import get_args_parser

    dests = {action.dest for action in get_args_parser()._actions}
    assert set(MODES) <= dests
    assert {dest for own in MODES.values() for dest in own} <= dests
    assert set(EMBEDDING) == set(EMBEDDING_OPTIONS) and set(EMBEDDING) <= dests


def test_ijbs_reading_processes_are_refused_elsewhere():
    assert _parse(CHECKPOINT + TARGETS["ijb"] + ["--workers", "3"]).mode == "ijb"
    with pytest.raises(DataError, match="--workers goes with --ijb"):
        _parse(CHECKPOINT + TARGETS["pairs"] + ["--workers", "3"])
