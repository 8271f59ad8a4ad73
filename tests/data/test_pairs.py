"""LFW pairs files: parsing, image resolution, missing images, generation and writing."""

from __future__ import annotations

import itertools
import math
import random
from pathlib import Path

import numpy as np
import pytest

from facenet.cli import make_pairs as make_pairs_script
from facenet.data import pairs as pairs_module
from facenet.data.pairs import (
    MissingImagesError,
    PairFold,
    PairsFormatError,
    generate_pairs,
    lfw_image_index,
    read_pairs,
    scan_identities,
    write_pairs,
)
from facenet.errors import DataError
from facenet.evaluation.presets import VerifySettings
from facenet.evaluation.protocol import evaluate_verification


def make_lfw_folder(root: Path, counts: dict[str, int], ext: str = ".jpg") -> dict[str, list[str]]:
    """Empty files ``root/<name>/<name>_<k:04d><ext>``, k = 1..count (content is never read)."""
    listing = {}
    for name, count in counts.items():
        (root / name).mkdir(parents=True, exist_ok=True)
        listing[name] = [f"{name}_{k:04d}{ext}" for k in range(1, count + 1)]
        for file_name in listing[name]:
            (root / name / file_name).touch()
    return listing


# --------------------------------------------------------------------------- reading


@pytest.fixture
def lfw(tmp_path):
    """A small LFW layout: Alice 3 images, Bob 2 (one .PNG), Carol 1 (.jpeg)."""
    make_lfw_folder(tmp_path, {"Alice": 3, "Bob": 1})
    make_lfw_folder(tmp_path, {"Carol": 1}, ext=".jpeg")
    (tmp_path / "Bob" / "Bob_0002.PNG").touch()
    return tmp_path


def test_reads_lfw_format_with_crlf_stray_spaces_and_blank_lines(lfw):
    text = (
        " 2\t2 \r\n"
        "Alice\t1\t2\r\n"
        "Bob  1 2\r\n"
        "Alice\t1\tBob\t2 \r\n"
        "\r\n"
        "Carol 1 Alice 3\r\n"
        "Alice\t2\t3\r\n"
        "Alice 1 3\r\n"
        "\tBob\t1\tCarol\t1\r\n"
        "Alice 2 Carol 1\r\n"
    )
    (lfw / "pairs.txt").write_bytes(text.encode())
    pairs = read_pairs(lfw / "pairs.txt")
    assert (pairs.n_folds, pairs.pairs_per_fold, len(pairs)) == (2, 2, 8)
    assert pairs.issame.tolist() == [True, True, False, False, True, True, False, False]
    assert pairs.paths1[1] == str(lfw / "Bob" / "Bob_0001.jpg")
    assert pairs.paths2[1] == str(lfw / "Bob" / "Bob_0002.PNG")  # any extension, any case
    assert pairs.paths1[3] == str(lfw / "Carol" / "Carol_0001.jpeg")
    assert pairs.fold_ids.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert pairs.line_numbers.tolist() == [2, 3, 4, 6, 7, 8, 9, 10]
    assert pairs.skipped == [] and pairs.skip_report() == ""


def test_unique_paths_index_both_sides(lfw):
    (lfw / "pairs.txt").write_text("1\t2\nAlice 1 2\nAlice 2 3\nAlice 1 Bob 1\nBob 2 Alice 3\n")
    pairs = read_pairs(lfw / "pairs.txt")
    paths, index1, index2 = pairs.unique_paths()
    assert paths == sorted(set(pairs.paths1 + pairs.paths2))
    assert [paths[i] for i in index1] == pairs.paths1
    assert [paths[i] for i in index2] == pairs.paths2


def test_extension_preference_when_a_stem_has_several_files(lfw):
    (lfw / "Alice" / "Alice_0001.png").touch()
    (lfw / "Alice" / "Alice_0002.webp").touch()
    (lfw / "Alice" / "Alice_0002.jpg").unlink()
    (lfw / "pairs.txt").write_text("1 1\nAlice 1 2\nAlice 1 Bob 1\n")
    pairs = read_pairs(lfw / "pairs.txt")
    assert Path(pairs.paths1[0]).name == "Alice_0001.jpg"  # jpg before png
    assert Path(pairs.paths2[0]).name == "Alice_0002.webp"


def test_root_given_explicitly(lfw, tmp_path_factory):
    elsewhere = tmp_path_factory.mktemp("lists") / "pairs.txt"
    elsewhere.write_text("1 1\nAlice 1 2\nAlice 1 Bob 1\n")
    assert read_pairs(elsewhere, root=lfw).paths1[0] == str(lfw / "Alice" / "Alice_0001.jpg")
    with pytest.raises(FileNotFoundError, match="image root"):
        read_pairs(elsewhere, root=lfw / "nope")


def test_the_header_may_record_the_image_folder(lfw):
    lists = lfw / "lists"
    lists.mkdir()
    pairs = [PairFold([("Alice", 1, 2)], [("Alice", 1, "Bob", 1)])]
    write_pairs(lists / "pairs.txt", pairs, root="..")
    assert (lists / "pairs.txt").read_text().splitlines()[0] == "1\t1\t.."
    found = read_pairs(lists / "pairs.txt")
    assert found.paths1[0] == str(lfw / "Alice" / "Alice_0001.jpg")
    with pytest.raises(MissingImagesError):  # a root given wins over the recorded one
        read_pairs(lists / "pairs.txt", root=lists)
    (lists / "moved.txt").write_text("1\t1\t../nope\nAlice 1 2\nAlice 1 Bob 1\n")
    with pytest.raises(PairsFormatError, match=r"moved.txt:1: the image folder it records, .*nope"):
        read_pairs(lists / "moved.txt")
    with pytest.raises(DataError, match="holds tabs"):
        write_pairs(lists / "tab.txt", pairs, root="a\tb")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("2\t1\nAlice 1 2\nAlice 1\nBob 1 2\nAlice 1 Bob 1\n", r"pairs.txt:3: expected 'name"),
        (
            "1\t1\nAlice 1 Bob\nAlice 1 Bob 1\n",
            r"pairs.txt:2: idx2 must be a non-negative .* 'Bob'",
        ),
        ("1\t2\nAlice 1 2\nAlice one 2\n", r"pairs.txt:3: idx1 must be a non-negative integer"),
        ("1\t1\nAlice 1 2\nAlice 1 Bob 1 Carol\n", r"pairs.txt:3: .* got 5 field"),
        ("ten 300\nAlice 1 2\n", r"pairs.txt:1: header value"),
        ("1\t2\nAlice 1 2\nAlice 1 Bob 1\n", r"pairs.txt:1: the header promises 1 fold"),
        ("\n\n", r"pairs.txt: empty pairs file"),
    ],
)
def test_malformed_lines_name_file_and_line(lfw, text, message):
    (lfw / "pairs.txt").write_text(text)
    with pytest.raises(PairsFormatError, match=message):
        read_pairs(lfw / "pairs.txt")


def test_missing_images_are_listed_once_with_their_lines(lfw):
    text = "1\t2\nAlice 1 4\nAlice 2 4\nAlice 1 Dave 1\nBob 1 Carol 1\n"
    (lfw / "pairs.txt").write_text(text)
    with pytest.raises(MissingImagesError) as caught:
        read_pairs(lfw / "pairs.txt")
    err = caught.value
    assert isinstance(err, FileNotFoundError)
    assert err.missing == [
        str(lfw / "Alice" / "Alice_0004") + ".*",
        str(lfw / "Dave" / "Dave_0001") + ".*",
    ]
    assert err.lines[str(lfw / "Alice" / "Alice_0004") + ".*"] == [2, 3]
    assert "2 image(s) named on 3 line(s)" in str(err) and "skip_missing" in str(err)
    line = err.named("--root", "--skip-missing")
    assert "\n" not in line and "skip_missing" not in line and "=" not in line
    assert f"not found under {lfw} (first: {lfw / 'Alice' / 'Alice_0004'}.*, line 2)" in line
    assert line.endswith(
        "give --root, the folder of the identity folders, or --skip-missing to skip those pairs"
    )


def test_skip_missing_counts_and_reports_the_effect_on_folds(lfw):
    text = "2\t1\nAlice 1 4\nAlice 1 Bob 1\nAlice 2 3\nBob 1 Dave 2\n"
    (lfw / "pairs.txt").write_text(text)
    with pytest.warns(UserWarning, match="skipped 2 of 4 pairs"):
        pairs = read_pairs(lfw / "pairs.txt", skip_missing=True)
    assert len(pairs) == 2 and pairs.issame.tolist() == [False, True]
    assert [line for line, _ in pairs.skipped] == [2, 5]
    assert "Alice_0004" in pairs.skipped[0][1]
    assert "(per fold: [1, 1])" in pairs.skip_report()
    assert pairs.fold_ids.tolist() == [0, 1]
    assert "re-split" in pairs.skip_report()


# --------------------------------------------------------------------------- generating


def test_lfw_image_index():
    assert lfw_image_index("Bob_Smith", "Bob_Smith_0012.JPG") == 12
    assert lfw_image_index("Bob_Smith", "/x/Bob_Smith/Bob_Smith_0003.png") == 3
    assert lfw_image_index("Bob", "Bob_Smith_0003.png") is None
    assert lfw_image_index("Bob", "Bob_0003.txt") is None


def check_folds(folds, listing: dict[str, list[str]], n_folds: int, per_fold: int):
    """LFW layout, valid and distinct pairs, identity-disjoint folds."""
    available = {name: {lfw_image_index(name, f) for f in files} for name, files in listing.items()}
    assert len(folds) == n_folds
    seen, identities_by_fold = set(), []
    for same, different in folds:
        assert len(same) == per_fold and len(different) == per_fold
        assert same == sorted(same) and different == sorted(different)
        for name, a, b in same:
            assert a < b and {a, b} <= available[name]
        for n1, a, n2, b in different:
            assert n1 < n2 and a in available[n1] and b in available[n2]
        seen.update(same + different)
        identities_by_fold.append({p[0] for p in same + different} | {p[2] for p in different})
    assert len(seen) == 2 * n_folds * per_fold  # no pair twice
    return identities_by_fold


def test_generated_folds_are_lfw_like_and_identity_disjoint():
    listing = {
        f"P{i:02d}": [f"P{i:02d}_{k:04d}.png" for k in range(1, 2 + i % 5)] for i in range(30)
    }
    folds = generate_pairs(listing, n_folds=5, pairs_per_fold=6, seed=3)
    identities = check_folds(folds, listing, 5, 6)
    for a, b in itertools.combinations(identities, 2):
        assert not a & b
    assert generate_pairs(listing, 5, 6, seed=3) == folds
    assert generate_pairs(listing, 5, 6, seed=4) != folds


def test_shared_identities_when_folds_need_not_be_disjoint():
    listing = {f"P{i}": [f"P{i}_{k:04d}.jpg" for k in range(1, 5)] for i in range(4)}
    # Each fold needs 2 identities for its different pairs: 4 identities cannot fill 3 folds.
    with pytest.raises(ValueError, match="no dealing of identities to folds gives every fold"):
        generate_pairs(listing, n_folds=3, pairs_per_fold=2)
    folds = generate_pairs(listing, n_folds=3, pairs_per_fold=6, disjoint_folds=False)
    check_folds(folds, listing, 3, 6)


def test_scarce_pairs_are_all_used_and_too_few_is_an_error():
    listing = {"A": ["A_0001.jpg", "A_0002.jpg", "A_0003.jpg"], "B": ["B_0001.jpg"]}
    folds = generate_pairs(listing, n_folds=1, pairs_per_fold=3)  # all 3 same, all 3 different
    assert sorted(folds[0].same) == [("A", 1, 2), ("A", 1, 3), ("A", 2, 3)]
    assert sorted(folds[0].different) == [("A", 1, "B", 1), ("A", 2, "B", 1), ("A", 3, "B", 1)]
    with pytest.raises(ValueError, match="3 same pairs exist, 4 needed"):
        generate_pairs(listing, n_folds=1, pairs_per_fold=4)
    with pytest.raises(ValueError, match="same pairs .* 4 distinct pairs needed, only 3"):
        generate_pairs(listing, n_folds=1, pairs_per_fold=4, disjoint_folds=False)


def test_any_file_names_round_trip_by_name(tmp_path):
    """Identities not named like LFW are referred to by file name (spaces included)."""
    names = {"Ann Lee": ["IMG 1.jpg", "b.png", "0002.JPG"], "bob": ["x.jpg", "y.jpg"]}
    for identity, files in names.items():
        (tmp_path / identity).mkdir()
        for k, name in enumerate(files):
            (tmp_path / identity / name).write_bytes(bytes([k]))
    (tmp_path / "bob" / "notes.txt").write_text("not an image")
    folds = generate_pairs(
        scan_identities(tmp_path), n_folds=1, pairs_per_fold=3, seed=0, disjoint_folds=False
    )
    write_pairs(tmp_path / "pairs.txt", folds)
    pairs = read_pairs(tmp_path / "pairs.txt")
    assert len(pairs) == 6 and pairs.issame.sum() == 3
    every = set(pairs.paths1) | set(pairs.paths2)
    assert (
        str(tmp_path / "Ann Lee" / "IMG 1.jpg") in every
        or str(tmp_path / "Ann Lee" / "b.png") in every
    )
    assert all(Path(p).is_file() and Path(p).suffix != ".txt" for p in every)


def test_names_a_pairs_file_cannot_hold_are_refused():
    with pytest.raises(ValueError, match="tabs"):
        generate_pairs({"A\tB": ["x.jpg", "y.jpg"], "C": ["z.jpg"]}, 1, 1)
    with pytest.raises(ValueError, match="image file name 'a.*b.jpg' holds tabs"):
        generate_pairs({"A": ["a\tb.jpg", "y.jpg"], "C": ["z.jpg"]}, 1, 1)


def test_a_file_name_reference_stays_in_its_identity_folder(tmp_path):
    (tmp_path / "A").mkdir()
    (tmp_path / "pairs.txt").write_text("1\t1\nA\t../../etc.jpg\tx.jpg\nA\t1\tB\t2\n")
    with pytest.raises(PairsFormatError, match="file name inside its identity folder"):
        read_pairs(tmp_path / "pairs.txt")


def test_write_then_read_round_trip(tmp_path):
    listing = make_lfw_folder(tmp_path, {f"Id{i}": 2 + i % 3 for i in range(12)})
    folds = generate_pairs(listing, n_folds=3, pairs_per_fold=4, seed=1)
    write_pairs(tmp_path / "pairs.txt", folds)
    lines = (tmp_path / "pairs.txt").read_text().splitlines()
    assert lines[0] == "3\t4" and len(lines) == 1 + 3 * 8
    assert lines[1] == "\t".join(map(str, folds[0].same[0]))
    pairs = read_pairs(tmp_path / "pairs.txt")
    expected = [pair for fold in folds for pair in fold.same + fold.different]
    assert pairs.issame.tolist() == [len(p) == 3 for p in expected]
    for path1, path2, pair in zip(pairs.paths1, pairs.paths2, expected):
        name2, idx2 = (pair[0], pair[2]) if len(pair) == 3 else (pair[2], pair[3])
        assert Path(path1).name == f"{pair[0]}_{pair[1]:04d}.jpg"
        assert Path(path2).name == f"{name2}_{idx2:04d}.jpg"
    assert scan_identities(tmp_path) == listing


def test_write_refuses_uneven_or_malformed_folds(tmp_path):
    good = PairFold([("A", 1, 2)], [("A", 1, "B", 1)])
    with pytest.raises(ValueError, match="fold 1 holds 0 same"):
        write_pairs(tmp_path / "p.txt", [good, PairFold([], [("A", 1, "B", 1)])])
    with pytest.raises(ValueError, match="malformed different pair"):
        write_pairs(tmp_path / "p.txt", [PairFold([("A", 1, 2)], [("A", 1, "B")])])
    with pytest.raises(ValueError, match="malformed same pair"):
        write_pairs(tmp_path / "p.txt", [PairFold([("A\tB", 1, 2)], [("A", 1, "B", 1)])])
    with pytest.raises(ValueError, match="malformed same pair"):
        write_pairs(tmp_path / "p.txt", [PairFold([("A", "x/y.jpg", 2)], [("A", 1, "B", 1)])])
    with pytest.raises(ValueError, match="malformed different pair"):  # the reader refuses it
        write_pairs(tmp_path / "p.txt", [PairFold([("A", 1, 2)], [("A", 1, "../B", 1)])])
    assert not (tmp_path / "p.txt").exists()


# --------------------------------------------------------------------------- make_pairs.py


def test_make_pairs_script_writes_a_readable_file(tmp_path, capsys):
    make_lfw_folder(tmp_path / "lfw", {f"Id{i}": 3 for i in range(8)})
    argv = [str(tmp_path / "lfw"), "--folds", "2", "--pairs-per-fold", "3", "--seed", "5"]
    assert make_pairs_script.main(argv) == 0
    assert "wrote" in capsys.readouterr().out
    pairs = read_pairs(tmp_path / "lfw" / "pairs.txt")
    assert len(pairs) == 12 and pairs.issame.sum() == 6


def test_make_pairs_script_takes_any_names_and_writes_only_its_output(tmp_path, capsys):
    for name in ("x", "y", "z"):
        (tmp_path / "raw" / name).mkdir(parents=True)
        for k in range(3):
            (tmp_path / "raw" / name / f"frame {k}.JPG").write_bytes(bytes([k]))
    before = sorted(str(p) for p in (tmp_path / "raw").rglob("*"))
    out = tmp_path / "new" / "folder" / "pairs.txt"  # a parent that does not exist yet
    argv = [str(tmp_path / "raw"), "--folds", "1", "--pairs-per-fold", "2", "--out", str(out)]
    assert make_pairs_script.main(argv) == 0
    assert sorted(str(p) for p in (tmp_path / "raw").rglob("*")) == before  # images untouched
    pairs = read_pairs(out, root=tmp_path / "raw")
    assert len(pairs) == 4
    assert all((tmp_path / "raw") in Path(p).parents for p in pairs.paths1 + pairs.paths2)


def test_make_pairs_script_never_replaces_an_existing_file(tmp_path, capsys):
    make_lfw_folder(tmp_path / "lfw", {f"Id{i}": 3 for i in range(8)})
    official = tmp_path / "lfw" / "pairs.txt"
    official.write_text("10\t300\n")
    (tmp_path / "link.txt").symlink_to(tmp_path / "nowhere")
    for argv in ([], ["--out", str(tmp_path / "link.txt")]):
        assert make_pairs_script.main([str(tmp_path / "lfw"), *argv]) == 2
        assert "exists" in capsys.readouterr().err
    assert official.read_text() == "10\t300\n" and not (tmp_path / "nowhere").exists()
    fake = tmp_path / "lfw" / "Id0" / "Id0_0009.PNG"
    assert make_pairs_script.main([str(tmp_path / "lfw"), "--out", str(fake)]) == 2
    assert "named like an image" in capsys.readouterr().err and not fake.exists()


def test_make_pairs_script_messages_name_its_flags(tmp_path, capsys):
    make_lfw_folder(tmp_path / "lfw", {f"Id{i}": 3 for i in range(4)})
    argv = [str(tmp_path / "lfw"), "--folds", "4", "--pairs-per-fold", "3"]
    assert make_pairs_script.main(argv) == 2
    err = capsys.readouterr().err
    assert "--pairs-per-fold 3" in err and "--shared-identities" in err
    assert "disjoint_folds" not in err


def test_make_pairs_script_reports_data_problems_with_exit_code_2(tmp_path, capsys):
    make_lfw_folder(tmp_path / "lfw", {f"Id{i}": 2 for i in range(3)})
    argv = [str(tmp_path / "lfw"), "--folds", "1", "--pairs-per-fold", "50"]
    assert make_pairs_script.main(argv) == 2  # too few images: a DataError
    assert capsys.readouterr().err.startswith("error: ")
    assert make_pairs_script.main([str(tmp_path / "absent")]) == 2  # an OSError
    assert "absent" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        make_pairs_script.main([str(tmp_path / "lfw"), "--folds", "0"])
    assert "--folds" in capsys.readouterr().err


def test_more_folds_than_the_identities_allow_are_refused_before_any_fold_is_made(
    tmp_path, capsys, monkeypatch
):
    """A billion identity-disjoint folds of ten identities: the counts refuse it at once, not
    after a billion folds' state is built."""
    make_lfw_folder(tmp_path / "lfw", {f"Id{i}": 3 for i in range(10)})

    def no_search(*args):
        raise AssertionError("the fold search started")

    monkeypatch.setattr(pairs_module, "_Search", no_search)
    for shared in ([], ["--shared-identities"]):
        argv = [str(tmp_path / "lfw"), "--folds", "1000000000", "--pairs-per-fold", "1", *shared]
        assert make_pairs_script.main(argv) == 2
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and "--folds 1000000000" in err, err
    listing = make_lfw_folder(tmp_path / "x", {"A": 40, "B": 2})  # 781 same pairs, 2 holders
    with pytest.raises(DataError, match=r"\(2 with 2\+ images\): every fold needs an identity"):
        generate_pairs(listing, n_folds=3, pairs_per_fold=1)


@pytest.mark.parametrize("seed", ["-1", str(2**63), "1.5"])
def test_make_pairs_script_takes_the_seeds_train_seed_takes(tmp_path, capsys, seed):
    make_lfw_folder(tmp_path / "lfw", {f"Id{i}": 3 for i in range(8)})
    argv = [str(tmp_path / "lfw"), "--folds", "2", "--pairs-per-fold", "3", "--seed"]
    with pytest.raises(SystemExit):
        make_pairs_script.main([*argv, seed])
    assert "--seed" in capsys.readouterr().err
    assert not (tmp_path / "lfw" / "pairs.txt").exists()
    assert make_pairs_script.main([*argv, str(2**63 - 1)]) == 0


def test_pairs_errors_belong_to_the_facenet_family(tmp_path):
    from facenet.errors import DataError

    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00\x01")
    with pytest.raises(PairsFormatError, match="not a UTF-8 text file") as err:
        read_pairs(tmp_path / "bin.txt", root=tmp_path)
    assert isinstance(err.value, DataError) and isinstance(err.value, ValueError)
    assert issubclass(MissingImagesError, DataError) and issubclass(MissingImagesError, OSError)


def test_a_one_fold_file_is_evaluated_in_folds_that_each_hold_both_kinds(tmp_path):
    make_lfw_folder(tmp_path, {"Alice": 3, "Bob": 3, "Carol": 3})
    same = ["Alice\t1\t2", "Alice\t1\t3", "Alice\t2\t3", "Bob\t1\t2", "Bob\t1\t3", "Carol\t1\t2"]
    different = [f"Alice\t{i}\tBob\t{j}" for i, j in ((1, 1), (1, 2), (2, 1), (2, 2), (3, 3))]
    different.append("Bob\t1\tCarol\t3")
    (tmp_path / "pairs.txt").write_text("6\n" + "\n".join(same + different) + "\n")  # one fold
    pairs = read_pairs(tmp_path / "pairs.txt")
    assert pairs.n_folds == 1
    folds = pairs.folds_for(3)
    assert folds.tolist() == [0, 0, 1, 1, 2, 2] * 2  # each kind cut into 3 runs, in file order
    distances = [0.1] * 6 + [0.9] * 6
    result = evaluate_verification(distances, pairs.issame, VerifySettings(n_folds=3), folds)
    assert result.accuracy.tolist() == [1.0, 1.0, 1.0]
    assert pairs.folds_for(1) is pairs.fold_ids  # the file's own folds
    assert pairs.folds_for(7) is None  # fewer same pairs than folds: the protocol says so


def test_lfw_lines_mixing_tabs_and_spaces_still_read(tmp_path):
    make_lfw_folder(tmp_path, {"Abel_Pacheco": 4, "Ann": 2})
    (tmp_path / "pairs.txt").write_text("1 1\nAbel_Pacheco 1\t4\nAbel_Pacheco\t1 Ann 2\n")
    pairs = read_pairs(tmp_path / "pairs.txt")
    assert list(pairs.issame) == [True, False]


@pytest.mark.parametrize("name", ["../../x", "/abs/dir", "..", "a\\\\b"])
def test_identities_outside_the_root_are_refused(tmp_path, name):
    (tmp_path / "pairs.txt").write_text(f"1\t1\n{name}\t1\t2\nA\t1\tB\t2\n")
    with pytest.raises(PairsFormatError, match="must be a folder name"):
        read_pairs(tmp_path / "pairs.txt")


def test_a_backslash_in_a_file_name_is_refused_by_name():
    with pytest.raises(ValueError, match="backslashes"):
        generate_pairs({"A": ["x\\\\1.png", "y.png"], "B": ["z.png"]}, 1, 1)


def test_a_fifo_as_the_pairs_file_is_refused_without_blocking(tmp_path):
    import os

    fifo = tmp_path / "pairs.txt"
    os.mkfifo(fifo)
    with pytest.raises(PairsFormatError, match="not a regular file"):
        read_pairs(fifo)


def test_a_pairs_file_past_the_size_bound_is_refused_before_it_is_read(tmp_path, monkeypatch):
    monkeypatch.setattr(pairs_module, "_MAX_PAIRS_BYTES", 64)
    (tmp_path / "pairs.txt").write_text("1\t1\n" + "Alice\t1\t2\n" * 10)
    with pytest.raises(
        PairsFormatError, match="pairs.txt: 104 bytes is larger than the 64 allowed"
    ):
        read_pairs(tmp_path / "pairs.txt")
    with pytest.raises(FileNotFoundError, match="absent.txt"):
        read_pairs(tmp_path / "absent.txt")


# --------------------------------------------------------------------------- fold assignment


def _fold_holds(sizes, members, per_fold):
    same = sum(math.comb(sizes[i], 2) for i in members)
    images = sum(sizes[i] for i in members)
    different = (images**2 - sum(sizes[i] ** 2 for i in members)) // 2
    return same >= per_fold and different >= per_fold


def _brute_force(sizes, n_folds, per_fold):
    """Whether any dealing of identities to folds lets every fold hold its pairs."""
    for dealing in itertools.product(range(n_folds), repeat=len(sizes)):
        groups = [[i for i, g in enumerate(dealing) if g == f] for f in range(n_folds)]
        if all(_fold_holds(sizes, g, per_fold) for g in groups):
            return True
    return False


def test_fold_assignment_finds_a_dealing_whenever_brute_force_does():
    from facenet.data.pairs import _assign_folds
    from facenet.errors import DataError

    rng = random.Random(0)
    found = 0
    for trial in range(600):
        n_ids, n_folds, per_fold = rng.randint(1, 8), rng.randint(2, 3), rng.randint(1, 12)
        sizes = [rng.choice([1, 1, 2, 2, 3, 4, 6, 9]) for _ in range(n_ids)]
        keys = {f"I{i}": list(range(1, s + 1)) for i, s in enumerate(sizes)}
        exists = _brute_force(sizes, n_folds, per_fold)
        try:
            folds = _assign_folds(keys, n_folds, per_fold, np.random.default_rng(trial))
        except DataError as err:
            assert not exists, (sizes, n_folds, per_fold, str(err))
            continue
        assert exists
        found += 1
        dealt = sorted(name for fold in folds for name in fold)
        assert dealt == sorted(keys)  # every identity once
        for fold in folds:
            assert _fold_holds(sizes, [int(name[1:]) for name in fold], per_fold)
    assert found > 100  # both outcomes are exercised


def test_one_large_identity_alone_no_longer_blocks_disjoint_folds():
    listing = {"Big": [f"Big_{k:04d}.jpg" for k in range(1, 31)]}
    listing.update({f"S{i:02d}": [f"S{i:02d}_0001.jpg", f"S{i:02d}_0002.jpg"] for i in range(12)})
    folds = generate_pairs(listing, n_folds=2, pairs_per_fold=10, seed=0)
    identities = check_folds(folds, listing, 2, 10)
    assert not identities[0] & identities[1]


def test_refusals_give_the_counts():
    listing = {f"P{i}": [f"P{i}_{k:04d}.jpg" for k in range(1, 3)] for i in range(5)}
    with pytest.raises(ValueError, match=r"from 5 identities \(5 with 2\+ images\): 5 same"):
        generate_pairs(listing, n_folds=3, pairs_per_fold=2)  # 5 same pairs, 6 needed
    single = {"A": [f"A_{k:04d}.jpg" for k in range(1, 5)], "B": ["B_0001.jpg"], "C": ["C.jpg"]}
    with pytest.raises(ValueError, match="every fold needs an identity with 2"):
        generate_pairs(single, n_folds=2, pairs_per_fold=1)  # 6 same pairs, all in A


def test_empty_identity_folders_are_ignored_with_a_warning(tmp_path, capsys):
    make_lfw_folder(tmp_path / "lfw", {f"Id{i}": 3 for i in range(4)})
    (tmp_path / "lfw" / "Empty").mkdir()
    for shared in ([], ["--shared-identities"]):
        (tmp_path / "lfw" / "pairs.txt").unlink(missing_ok=True)  # never replaced
        argv = [str(tmp_path / "lfw"), "--folds", "2", "--pairs-per-fold", "3", *shared]
        assert make_pairs_script.main(argv) == 0
        out, err = capsys.readouterr()
        assert err == "warning: ignored 1 identity folder(s) without images: Empty\n"
        assert "from 4 identities" in out
        assert "Empty" not in (tmp_path / "lfw" / "pairs.txt").read_text()


def test_pairs_name_every_image_training_reads(tmp_path):
    """One extension list: an identity's .gif is drawn into pairs and resolved when read."""
    make_lfw_folder(tmp_path, {"A": 2})
    make_lfw_folder(tmp_path, {"B": 1}, ext=".gif")
    assert scan_identities(tmp_path)["B"] == ["B_0001.gif"]
    write_pairs(tmp_path / "pairs.txt", generate_pairs(scan_identities(tmp_path), 1, 1))
    assert read_pairs(tmp_path / "pairs.txt").paths2[1] == str(tmp_path / "B" / "B_0001.gif")
