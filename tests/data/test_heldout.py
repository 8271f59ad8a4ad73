"""Held-out identities: the record of a run read back within bounds, and refused by name."""

import json
import os

import pytest
from PIL import Image

from facenet.data.heldout import HeldOutSettings, choose_held_out, hold_out
from facenet.errors import DataError

LISTING = {f"person{i:02d}": ["a.png", "b.png"] for i in range(12)}


def test_a_new_choice_is_recorded_and_read_back_on_resume(tmp_path):
    chosen, record = choose_held_out(LISTING, tmp_path, ["val", "test"], HeldOutSettings(4), True)
    assert sorted(map(len, chosen.values())) == [2, 2] and json.loads(record) == chosen
    (tmp_path / "heldout.json").write_text(record)
    again = choose_held_out(LISTING, tmp_path, ["val", "test"], HeldOutSettings(4), False)
    assert again == (chosen, None)


@pytest.mark.parametrize(
    ("contents", "message"),
    [
        ("[" * 100_000, "nested too deeply"),
        ('{"val": "person00"}', "not a record of held-out identities"),
        ('["person00"]', "not a record of held-out identities"),
        ('{"val": [1, 2]}', "not a record of held-out identities"),
        ("", "not readable JSON"),
    ],
)
def test_a_damaged_record_is_one_error_naming_it(tmp_path, contents, message):
    (tmp_path / "heldout.json").write_text(contents)
    with pytest.raises(DataError, match=message) as caught:
        choose_held_out(LISTING, tmp_path, ["val"], HeldOutSettings(4), False)
    assert str(tmp_path / "heldout.json") in str(caught.value)


def test_a_fifo_named_as_the_record_is_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "heldout.json")
    with pytest.raises(DataError, match="not a regular file"):
        choose_held_out(LISTING, tmp_path, ["val"], HeldOutSettings(4), False)


def test_hold_out_with_the_default_image_limits(tmp_path):
    root = tmp_path / "faces"
    for person in range(6):
        for index in range(3):
            (root / f"p{person}").mkdir(parents=True, exist_ok=True)
            Image.new("RGB", (8, 8), (person * 40, index * 80, 0)).save(
                root / f"p{person}/{index}.png"
            )
    held = hold_out(root, tmp_path, ["val"], HeldOutSettings(4, n_folds=2, pairs_per_fold=2), True)
    assert len(held.identities) == 4 and set(held.pairs) == {"val"}
