"""The benchmarks run in their quick modes, write their JSON and BENCHMARKS.md's tables, and what
they measure holds: the calibrated selection, graphs alive after a step, the report's targets."""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import (
    bench_evaluation,
    bench_miners,
    bench_pipeline,
    measure,
    run_all,
    tables,
    targets,
)
from benchmarks import bench_training_step as step
from facenet.memory import GRAPH_BYTES_ALIVE, GRAPH_BYTES_PEAK

REPO = Path(__file__).resolve().parents[1]

QUICK_SECTIONS = ("training_step", "evaluation", "pipeline")


def run_module(name: str, *args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    """``python -m benchmarks.<name>`` from the repository root in a fresh interpreter (its
    children are forked from that one)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, "-m", f"benchmarks.{name}", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory):
    """run_all --quick (without the miners: see the slow test) into a temporary folder."""
    out = tmp_path_factory.mktemp("bench")
    done = run_module(
        "run_all",
        "--quick",
        "--out-dir",
        str(out),
        "--skip",
        "miners",
        "--threads",
        "1",  # steady on a shared machine; the figures are not asserted on
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    return results, (out / "BENCHMARKS.md").read_text()


# ---------------------------------------------------------------- pure functions


def test_margin_passing_hand_case():
    margins = torch.tensor([0.1, 0.5, 0.3, 0.9, 0.7])
    margin = step.margin_passing(margins, 0.4)  # round(0.4 x 5) = 2 values below
    assert margin == pytest.approx(0.4)
    assert int((margins < margin).sum()) == 2


@pytest.mark.parametrize("seed", range(5))
def test_margin_passing_lets_exactly_the_fraction_through(seed):
    gen = torch.Generator().manual_seed(seed)
    margins = torch.randn(int(torch.randint(5, 400, (1,), generator=gen)), generator=gen)
    fraction = float(torch.rand((), generator=gen)) * 0.8 + 0.1
    margin = step.margin_passing(margins, fraction)
    expected = max(1, min(len(margins) - 1, round(fraction * len(margins))))
    assert int((margins < margin).sum()) == expected


def test_case_ratios_from_hand_figures():
    variants = {
        "seed": {GRAPH_BYTES_PEAK: 400},
        "two_pass": {GRAPH_BYTES_PEAK: 100},
        "one_pass": {"error": "failed"},
    }
    rounds = {"floor_s": 1.0, "seed_step_s": 3.0, "two_pass_step_s": 1.1, "seed_parts_s": 0.9}
    ratios = step.case_ratios(variants, rounds)
    assert ratios["graph_peak_two_pass_vs_seed"] == pytest.approx(0.25)
    assert ratios["throughput_two_pass_vs_seed"] == pytest.approx(3.0 / 1.1)  # same rounds
    assert ratios["two_pass_overhead_above_floor"] == pytest.approx(0.1)
    assert ratios["seed_step_vs_floor"] == pytest.approx(3.0)
    assert ratios["seed_parts_vs_floor"] == pytest.approx(0.9)
    assert "graph_peak_one_pass_vs_seed" not in ratios  # a failed variant gives no ratio
    assert "throughput_one_pass_vs_seed" not in ratios  # nor a time


def _triplet_case(selection, ratios):
    return {
        "case": {"name": selection, "batch": "triplets", "selection": selection},
        "ratios": ratios,
        "variants": {},
    }


NAMES = ("peak graph bytes, two-pass", "images/s", "two-pass step above the floor")


def test_targets_are_met_missed_or_not_measured():
    sections = {
        "training_step": {
            "cases": [
                _triplet_case(
                    "dense",
                    {"graph_peak_two_pass_vs_seed": 0.5, "throughput_two_pass_vs_seed": 1.49},
                ),
                _triplet_case(
                    "sparse",
                    {"graph_peak_two_pass_vs_seed": 0.16, "two_pass_overhead_above_floor": 0.05},
                ),
            ]
        }
    }
    rows = targets.all_targets(sections)
    met = {name: [t["met"] for t in rows if t["target"].startswith(name)] for name in NAMES}
    assert met["peak graph bytes, two-pass"] == [True, False]  # 0.5 <= 0.5; 0.16 > 0.15
    assert met["images/s"] == [False, None]
    assert met["two-pass step above the floor"] == [None, True]


def test_miner_targets_read_the_1024_row_and_the_slowest_case():
    rows = [
        {"batch": 1024, "identities": 64, "miner": "all", "speedup": 4.0, "memory_ratio": 2.0},
        {"batch": 1024, "identities": 64, "miner": "semihard", "speedup": 3.0, "memory_ratio": 5.0},
        {"batch": 256, "identities": 16, "miner": "hard", "speedup": 0.9, "memory_ratio": 9.0},
    ]
    rows_out = targets.all_targets({"miners": {"rows": rows}})
    assert [t["met"] for t in rows_out] == [True, False, True, True, False]
    assert rows_out[-1]["measured"] == pytest.approx(0.9)


def test_md_table_escapes_bars_and_right_aligns_numbers():
    table = tables.md_table(["name", "value"], [["a|b", "1.5x"], ["c", None]])
    lines = table.splitlines()
    assert lines[1] == "| --- | ---: |"
    assert "a\\|b" in lines[2] and lines[3] == "| c | - |"


def test_table_shows_the_keys_bytes_in_mib_and_a_row_s_error():
    rows = [
        {"name": "a", "peak_bytes": 3 * 2**20, "ratio": 0.12345, "n": 1024, "ok": True},
        {"name": "b", "error": "failed|here"},
    ]
    lines = tables.table(["name", "peak_bytes", "ratio", "n", "ok"], rows).splitlines()
    assert lines[0] == "| name | peak_bytes (MiB) | ratio | n | ok |"
    assert lines[2] == "| a | 3.0 | 0.1235 | 1,024 | yes |"
    assert lines[3] == "| b | failed\\|here | - | - | - |"


def test_fill_tables_replaces_only_what_is_between_the_markers():
    text = (
        "Prose 1.5x by hand.\n<!-- table:a -->\n| old |\n<!-- /table -->\nMore prose.\n"
        "<!-- table:b -->\n| old b |\n<!-- /table -->\n"
    )
    filled, missing = tables.fill_tables(text, {"a": "| new |"})
    assert filled == (
        "Prose 1.5x by hand.\n<!-- table:a -->\n| new |\n<!-- /table -->\nMore prose.\n"
        f"<!-- table:b -->\n{tables.NOT_MEASURED}\n<!-- /table -->\n"
    )
    assert missing == ["b"]  # no figure of an older run stays
    assert tables.fill_tables(filled, {"a": "| new |"})[0] == filled  # the same run, the same text


def test_the_committed_tables_are_those_of_the_committed_results():
    results = json.loads((REPO / "benchmarks" / "results.json").read_text())
    markdown = (REPO / "BENCHMARKS.md").read_text()
    filled, _ = tables.fill_tables(markdown, tables.render_tables(results))
    assert filled == markdown


def test_each_runner_names_its_module_and_its_command():
    assert run_all.SECTIONS == (
        "training_step",
        "miners",
        "evaluation",
        "pipeline",
    )
    for name, module in run_all.RUNNERS:
        command = run_all.command(name, module, ["--threads", "1"])
        assert command.startswith(f"python -m benchmarks.{module} ")
        assert command.endswith(f"--json {name}.json")


# ---------------------------------------------------------------- the quick run


def test_quick_run_writes_every_section_and_the_markdown(quick_report):
    results, markdown = quick_report
    for name in QUICK_SECTIONS:
        assert "error" not in results["sections"][name], results["sections"][name]
    for heading in (
        "## Targets",
        "## 1. Training step",
        "## 3. Evaluation",
        "## 5. The input pipeline",
        "## GPU",
        "## Closing notes",
        "shared 2-core machine",
    ):
        assert heading in markdown
    for name in QUICK_SECTIONS:
        assert results["commands"][name] in markdown  # each table says how to repeat it
    statuses = {t["met"] for t in results["targets"]}
    assert statuses <= {True, False, None} and statuses
    # Every table of the sections that ran is filled from this run, none left from another.
    filled = tables.render_tables(results)
    for name in (
        "targets",
        "training_step_cases",
        "training_step_floor",
        "training_step_default",
        "evaluation",
        "pipeline_loader",
    ):
        assert filled[name] in markdown
    assert "miners" not in filled and "<!-- table:miners -->\n" + tables.NOT_MEASURED in markdown


def test_quick_training_step_selection_and_graphs(quick_report):
    results, _ = quick_report
    cases = results["sections"]["training_step"]["cases"]
    triplet_cases = [c for c in cases if c["case"]["batch"] == "triplets"]
    assert {c["case"]["selection"] for c in triplet_cases} == {"sparse", "dense"}
    for result in triplet_cases:
        calibration, variants = result["calibration"], result["variants"]
        wanted = step.SPARSE_FRACTION if result["case"]["selection"] == "sparse" else 1.0
        case = step.Case(**{k: v for k, v in result["case"].items() if k not in ("name", "images")})
        hard = step.hard_triplets_per_batch(case) if case.selection == "sparse" else case.triplets
        for kind in ("seed", "ours"):  # each margin selects the hard triplets of every batch
            assert calibration[f"passing_per_batch_{kind}"] == [hard] * (case.repeats + 1)
            assert abs(calibration[f"pass_fraction_{kind}"] - wanted) <= 0.1
        seed, two = variants["seed"], variants["two_pass"]
        assert "error" not in two, two
        assert two[GRAPH_BYTES_ALIVE] == 0  # nothing outlives our step
        assert 0 < two[GRAPH_BYTES_PEAK]
        if "error" not in seed:
            assert seed[GRAPH_BYTES_ALIVE] > 0  # the seed's loop variables hold graphs
            assert two[GRAPH_BYTES_PEAK] < seed[GRAPH_BYTES_PEAK]
        rounds = result["rounds"]  # every variant timed in the same rounds, and the floor
        assert rounds["floor_s"] > 0 and rounds["seed_step_s"] > 0 and rounds["two_pass_step_s"] > 0
    dense = next(c for c in triplet_cases if c["case"]["selection"] == "dense")
    assert dense["variants"]["two_pass"]["selected_fraction"] == 1.0


def test_quick_chunk_rows_measure_both_variants(quick_report):
    results, _ = quick_report
    report = results["sections"]["training_step"]
    pk_cases = [c for c in report["cases"] if c["case"]["batch"] == "pk"]
    assert len(pk_cases) == 2
    for result in pk_cases:
        two = result["variants"]["two_pass"]
        assert two[GRAPH_BYTES_ALIVE] == 0
        assert two["selected_images_mean"] == result["case"]["p"] * result["case"]["k"]
        assert result["variants"]["two_pass_chunked"][GRAPH_BYTES_PEAK] < two[GRAPH_BYTES_PEAK]


def test_quick_pk_rows_time_the_default_path_and_its_meter(quick_report):
    results, _ = quick_report
    for result in results["sections"]["training_step"]["cases"]:
        if result["case"]["batch"] == "pk":  # semi-hard mining selects every image: one pass
            assert result["variants"]["auto"]["step"] == "one-pass"
            assert result["variants"]["two_pass"]["step"] == "two-pass"
            assert result["rounds"]["auto_metered_step_s"] > 0
            assert result["rounds"]["medians"]["auto_metered_step_s"] > 0
            for key in ("two_pass_vs_auto", "meter_on_vs_off"):
                assert result["ratios"][key] > 0


def test_quick_pipeline_measures_both_loaders_and_both_input_paths(quick_report):
    results, _ = quick_report
    report = results["sections"]["pipeline"]
    assert [r["workers"] for r in report["loader"]] == [0, 1, 2] * 2  # at 32 and 112 px
    for row in report["loader"]:
        assert row["ours"] > 0 and row["torchvision"] > 0
    assert [r["workers"] for r in report["training"]] == [0, 1]
    for row in report["training"]:
        assert row["step_images_per_s"] > 0 and row["end_to_end_images_per_s"] > 0
    assert [r["format"] for r in report["index"]] == ["JPEG", "PNG"]


def test_quick_evaluation_numbers_are_identical(quick_report):
    results, _ = quick_report
    cases = results["sections"]["evaluation"]["cases"]
    assert cases and all(c["identical"] for c in cases)


# ---------------------------------------------------------------- the GPU check


def test_gpu_suite_runs_on_cpu_with_a_tiny_model(tmp_path):
    out = tmp_path / "gpu.json"
    argv = ["--suite", "gpu", "--quick", "--device", "cpu", "--pk-search", "8,16"]
    done = run_module("bench_training_step", *argv, "--json", str(out), "--threads", "1")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    cases = step.gpu_cases(quick=True)
    assert [c["case"]["name"] for c in report["cases"]] == [c.name for c in cases]
    assert {c["case"]["amp"] for c in report["cases"]} == {"none", "bf16"}
    for result in report["cases"]:
        assert (result["case"]["device"], result["case"]["backbone"]) == ("cpu", "tiny")
        assert "error" not in result["variants"]["two_pass"], result["variants"]["two_pass"]
    assert [r["batch"] for r in report["pk_search"] if r["chunk_size"] == 0] == [8, 16]


def test_gpu_check_measures_facenet_1800_on_cpu_with_a_tiny_model(tmp_path):
    """gpu_check.sh's suite, its CUDA-only measurements marked so: every case in its list,
    each written as measured, the table beside the JSON."""
    out = tmp_path / "gpu_check.json"
    argv = ["--suite", "facenet1800", "--quick", "--device", "cpu", "--threads", "1"]
    done = run_module("bench_training_step", *argv, "--json", str(out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(out.read_text())["facenet_1800"]
    assert tuple(results) == step.FACENET_1800_CASES
    assert ("default", "chunked", "seed_largest") == step.FACENET_1800_CASES[:3]
    assert (results["default"]["step"], results["chunked"]["step"]) == ("one-pass", "chunked")
    assert all("images_per_s" in row for row in results["seed_largest"])
    assert set(results["ours_at_seed_batch"]) == {"default", "chunked"}
    assert results["ours_at_seed_batch"]["default"]["images"] >= 2 * 4
    assert "error" in results["sync_debug"] and "error" in results["cuda_tests"]  # CUDA only
    table = out.with_suffix(".md").read_text()
    assert "| default | one-pass |" in table and "| chunked | chunked |" in table
    script = (REPO / "benchmarks" / "gpu_check.sh").read_text()
    assert "--suite facenet1800" in script and "pip install" not in script
    assert "make install" not in script and ".venv" not in script  # a bare machine
    assert all(name in script for name in step.FACENET_1800_CASES)  # its header names each


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the check would run")
def test_gpu_check_refuses_without_cuda(tmp_path):
    done = subprocess.run(
        ["bash", "benchmarks/gpu_check.sh"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable},
    )
    assert done.returncode == 2
    assert "sees no CUDA" in done.stderr
    assert not list(tmp_path.iterdir())  # nothing written


# ---------------------------------------------------------------- everything, slowly


@pytest.mark.slow
def test_run_all_quick_with_the_miners(tmp_path):
    done = run_module(
        "run_all",
        "--quick",
        "--out-dir",
        str(tmp_path),
        "--threads",
        "1",
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["sections"]["miners"]["rows"]
    assert "## 2. Miners" in (tmp_path / "BENCHMARKS.md").read_text()


# ---------------------------------------------------------------- the shared argument check

RUNNERS = (bench_evaluation, bench_miners, bench_pipeline, step, run_all)


def one_line_exit_2(main, argv: list[str], capsys) -> str:
    """The single stderr line ``main(argv)`` stops with, exit status 2."""
    try:
        code = main(argv)
    except SystemExit as stop:
        code = stop.code
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, (code, err)
    return err


@pytest.mark.parametrize("runner", RUNNERS, ids=lambda m: m.__name__)
@pytest.mark.parametrize(
    "flag, value",
    [("--threads", "0"), ("--threads", "-1"), ("--threads", "two"), ("--json", "{file}/r.json")],
)
def test_every_runner_refuses_a_bad_argument_in_one_line(runner, flag, value, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    if runner is run_all and flag == "--json":
        flag = "--out-dir"
    value = value.format(file=tmp_path / "file")
    assert flag in one_line_exit_2(runner.main, [flag, value], capsys)
    assert [p.name for p in tmp_path.iterdir()] == ["file"]


@pytest.mark.parametrize("device", ["tpu", "cuda:x", "meta", ""])
def test_the_training_step_refuses_a_device_it_cannot_measure(device, capsys):
    assert "--device" in one_line_exit_2(step.main, ["--device", device], capsys)


def test_argument_types_take_finite_positive_numbers_and_usable_paths(tmp_path):
    assert measure.positive_float("0.5") == 0.5
    for bad in ("nan", "inf", "-inf", "0", "-3", "1e400"):
        with pytest.raises(argparse.ArgumentTypeError, match="finite number > 0"):
            measure.positive_float(bad)
    (tmp_path / "file").write_text("")
    os.mkfifo(tmp_path / "fifo")
    assert measure.input_path(str(tmp_path / "file")) == tmp_path / "file"
    assert measure.input_path(str(tmp_path), folder=True) == tmp_path
    for bad, folder in (("fifo", False), ("missing", False), (".", False), ("file", True)):
        with pytest.raises(argparse.ArgumentTypeError, match="no such (regular file|folder)"):
            measure.input_path(str(tmp_path / bad), folder=folder)
    new = tmp_path / "a" / "b" / "r.json"
    assert measure.output_path(str(new)) == new and not (tmp_path / "a").exists()  # made later
    assert measure.output_path(str(tmp_path), folder=True) == tmp_path
    for bad, folder, why in (
        (tmp_path, False, "is a folder"),
        (tmp_path / "file", True, "is not a folder"),
        (tmp_path / "file" / "x" / "r.json", False, "cannot write in"),
        (tmp_path / "fifo" / "run", True, "cannot write in"),
    ):
        with pytest.raises(argparse.ArgumentTypeError, match=why):
            measure.output_path(str(bad), folder=folder)


def test_run_all_refuses_unreadable_reports_in_one_line(tmp_path, capsys):
    (tmp_path / "broken.json").write_text("{not json")
    (tmp_path / "list.json").write_text("[]")
    for name in ("broken.json", "list.json"):
        argv = ["--tables-only", "--out-dir", str(tmp_path), "--gpu-json", str(tmp_path / name)]
        assert f"--gpu-json {tmp_path / name}" in one_line_exit_2(run_all.main, argv, capsys)
    err = one_line_exit_2(run_all.main, ["--tables-only", "--out-dir", str(tmp_path)], capsys)
    assert str(tmp_path / "results.json") in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken.json", "list.json"]


def test_a_report_that_cannot_be_written_is_one_line_exit_2(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    parser = measure.benchmark_parser("A benchmark.")
    json_path = tmp_path / "file" / "r.json"
    args = ["--json", str(tmp_path / "r.json")]
    # The path was fine when checked; the folder became a file before the report was written.
    code = measure.run_benchmark(parser, args, lambda a: setattr(a, "json", json_path) or {})
    assert code == 2 and f"--json {json_path}: cannot write" in capsys.readouterr().err


def test_run_all_refuses_a_markdown_it_cannot_write_in_one_line(tmp_path, capsys):
    (tmp_path / "results.json").write_text((REPO / "benchmarks" / "results.json").read_text())
    (tmp_path / "BENCHMARKS.md").mkdir()  # a folder where the tables go
    argv = ["--tables-only", "--out-dir", str(tmp_path)]
    assert "BENCHMARKS.md" in one_line_exit_2(run_all.main, argv, capsys)
