"""facenet-audit's options and facenet-evaluate's ``--show-errors``, parsed (no model): the
settings a preset gives and flags override, the refusals."""

import pytest

from facenet.cli.audit import _parse
from facenet.cli.audit import main as audit_main
from facenet.cli.evaluate import _parse as parse_evaluate
from facenet.errors import DataError
from facenet.evaluation.presets import EVAL_PRESETS, VerifySettings

LINE = ["--checkpoint", "m.pt", "--train", "faces/", "--pairs", "pairs.txt"]


def test_the_settings_are_the_classic_ones_unless_a_preset_or_a_flag_says():
    assert VerifySettings.of(_parse(LINE)) == VerifySettings()
    preset = VerifySettings.of(_parse([*LINE, "--preset", "mobilefacenet"]))
    assert preset == EVAL_PRESETS["mobilefacenet"]
    flags = ["--preset", "mobilefacenet", "--preprocess", "resize", "--folds", "5"]
    mixed = VerifySettings.of(_parse([*LINE, *flags]))
    assert (mixed.preprocess, mixed.n_folds, mixed.flip) == ("resize", 5, True)


@pytest.mark.parametrize("quantile", ["0", "1", "-0.1", "x"])
def test_a_quantile_outside_zero_to_one_is_refused(quantile, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _parse([*LINE, "--quantile", quantile])
    assert exit_info.value.code == 2 and "--quantile" in capsys.readouterr().err


def test_show_errors_belongs_to_the_pairs_mode():
    shown = parse_evaluate(["--checkpoint", "m.pt", "--pairs", "p.txt", "--show-errors", "4"])
    assert (shown.mode, shown.show_errors) == ("pairs", 4)
    with pytest.raises(DataError, match="--show-errors goes with --pairs"):
        parse_evaluate(["--checkpoint", "m.pt", "--bin", "lfw.bin", "--show-errors", "4"])
    with pytest.raises(DataError, match="--show-errors goes with --pairs"):
        parse_evaluate(["--distances", "d.npz", "--show-errors", "4"])


def test_missing_pair_images_are_one_line_naming_the_audit_s_options(tiny_run, tmp_path, capsys):
    (tmp_path / "faces").mkdir()
    pairs = tmp_path / "pairs.txt"
    pairs.write_text("1\t1\nAnn\t1\t2\nAnn\t1\tBob\t1\n")
    argv = ["--checkpoint", str(tiny_run["checkpoint"]), "--train", str(tmp_path / "faces")]
    argv += ["--pairs", str(pairs), "--out", str(tmp_path / "out")]
    assert audit_main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {pairs}: 3 image(s) named")
    assert "give --root, " in err and "or --skip-missing to skip those pairs" in err
    assert "root=" not in err and "skip_missing" not in err
