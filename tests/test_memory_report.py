"""The memory report, measured: the seed loop keeps graphs alive after a step and the corrected
steps keep none; the JSON has every key; the timeline names the lines that hold memory; the
chart shows what each phase of a step holds, the seed's loop beside ours."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

from benchmarks import memory_report, seed_loop
from facenet.memory import GraphMemoryMeter
from facenet.models.embedding import EmbeddingNet

T, SIZE, STEPS, DIM, CLASSES = 4, 16, 2, 128, 10
# Unit embeddings: d_n - d_p <= 2 < 5, so the seed's rule selects every triplet.
MARGIN = 5.0
OUT_LINE = "out_a, out_p, out_n = model(data_a), model(data_p), model(data_n)"
D_P_LINE = "d_p = l2_dist.forward(out_a, out_p)"
D_N_LINE = "d_n = l2_dist.forward(out_a, out_n)"
CORRECTED = ("two_pass", "one_pass", "two_pass_pk", "one_pass_pk")
ARGV = [
    "--backbone", "tiny", "--image-size", str(SIZE), "--batch-size", str(T),
    "--steps", str(STEPS), "--device", "cpu", "--margin", str(MARGIN),
]  # fmt: skip


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One report on a tiny model: the returned report, the JSON file's contents and the
    chart's path."""
    folder = tmp_path_factory.mktemp("memory_report")
    json_path, plot = folder / "report.json", folder / "charts" / "phases.png"
    report = memory_report.main([*ARGV, "--json", str(json_path), "--plot", str(plot)])
    return {"report": report, "json": json.loads(json_path.read_text()), "plot": plot}


def reference_seed_graph_bytes(batch):
    """Measured afresh: graph bytes of the seed's three mining forwards, and with d_p and d_n."""
    torch.manual_seed(0)
    model = seed_loop.SeedModel(EmbeddingNet("tiny", embedding_dim=DIM), CLASSES)
    meter = GraphMemoryMeter(exclude=model)
    data_a, data_p, data_n = batch[:3]
    with meter:
        out_a, out_p, out_n = model(data_a), model(data_p), model(data_n)
        forwards = meter.alive_bytes
        d_p = seed_loop.l2_dist.forward(out_a, out_p)
        d_n = seed_loop.l2_dist.forward(out_a, out_n)
        retained = meter.alive_bytes
    del out_a, out_p, out_n, d_p, d_n
    return forwards, retained


def last_batch():
    return memory_report.make_triplet_batches(STEPS, T, SIZE, CLASSES, seed=0)[-1]


# --------------------------------------------------------------------------- graphs after a step


def test_seed_loop_keeps_graph_bytes_alive_and_corrected_steps_keep_none(run):
    variants = run["report"]["variants"]
    _, retained = reference_seed_graph_bytes(last_batch())
    seed = variants["seed"]
    assert seed["graph_bytes_alive"] == retained > 0
    assert all(step["graph_bytes_alive"] == retained for step in seed["per_step"])
    assert seed["graph_bytes_after_loop_variables_deleted"] == 0
    for name in CORRECTED:
        figures = variants[name]
        assert figures["graph_bytes_peak"] > 0  # the grad forward did hold activations
        assert figures["graph_bytes_alive"] == 0
        assert all(step["graph_bytes_alive"] == 0 for step in figures["per_step"])


def test_seed_peak_holds_two_steps_of_graphs(run):
    variants = run["report"]["variants"]
    forwards, retained = reference_seed_graph_bytes(last_batch())
    seed_second_step = variants["seed"]["per_step"][1]
    # Step 2's three forwards run while step 1's graphs are still bound to the loop variables.
    assert seed_second_step["graph_bytes_peak"] >= retained + forwards
    out_line = next(r for r in run["report"]["seed_timeline"]["lines"] if r["line"] == OUT_LINE)
    assert out_line["alive_bytes"] == retained + forwards
    # Every triplet is selected: the two-pass step forwards the same 3T images once, with grad.
    assert variants["seed"]["graph_bytes_peak"] >= 1.9 * variants["two_pass"]["graph_bytes_peak"]


def test_images_forwarded_per_step(run):
    variants = run["report"]["variants"]
    assert variants["seed"]["selected_triplets"] == T
    # Three full-batch forwards, then forward_classifier's three on the selected images.
    assert variants["seed"]["images_forwarded_with_grad"] == 3 * T + 3 * T
    assert variants["seed"]["images_forwarded_no_grad"] == 0
    for step in variants["seed"]["per_step"]:
        assert step["images_forwarded_with_grad"] == 3 * T + 3 * step["selected_triplets"]
    for figures in variants.values():
        per_step = [step["images_forwarded_with_grad"] for step in figures["per_step"]]
        assert sum(per_step) == figures["images_forwarded_with_grad"] * STEPS
    for name in ("two_pass", "two_pass_pk"):
        assert variants[name]["images_forwarded_no_grad"] == 3 * T
        assert 0 < variants[name]["images_forwarded_with_grad"] <= 3 * T
    for name in ("one_pass", "one_pass_pk"):
        assert variants[name]["images_forwarded_no_grad"] == 0
        assert variants[name]["images_forwarded_with_grad"] == 3 * T


# --------------------------------------------------------------------------- the JSON


def test_json_has_every_key_per_variant(run):
    written = run["json"]
    assert set(written["variants"]) == {"seed", *CORRECTED}
    for name, figures in written["variants"].items():
        missing = [key for key in memory_report.REQUIRED_KEYS if key not in figures]
        assert not missing, f"{name} lacks {missing}"
        assert figures["step_seconds"] > 0
        for key in memory_report.REQUIRED_KEYS[:-1]:
            assert isinstance(figures[key], int) and figures[key] >= 0, (name, key)
        assert not any(key in figures for key in memory_report.CUDA_KEYS)  # measured on CPU
        assert len(figures["per_step"]) == STEPS
    assert written["config"]["device"] == "cpu"
    assert written["config"]["pk"] == {"P": T, "K": 3}  # 3T images
    assert written == json.loads(json.dumps(run["report"]))  # the file is the returned report


def test_state_bytes_against_the_model(run):
    variants = run["report"]["variants"]
    model = EmbeddingNet("tiny", embedding_dim=DIM, num_classes=CLASSES)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    tensors = len(list(model.parameters()))
    for name, figures in variants.items():
        assert figures["param_bytes"] == param_bytes, name  # the same network in every variant
        assert figures["grad_bytes_at_optimizer_step"] == param_bytes, name
        # Adagrad: a running sum per parameter plus a scalar step counter per tensor.
        assert param_bytes < figures["optimizer_state_bytes"] <= param_bytes + 8 * tensors
    assert variants["seed"]["grad_bytes"] == param_bytes  # zero_grad() before backward: kept
    assert all(variants[name]["grad_bytes"] == 0 for name in CORRECTED)  # set_to_none after


# --------------------------------------------------------------------------- the timeline


def test_timeline_names_the_lines_that_hold_memory(run):
    timeline = run["report"]["seed_timeline"]
    seed = run["report"]["variants"]["seed"]
    rows = timeline["lines"]
    change = {row["line"]: row["change_bytes"] for row in rows}
    assert max(change, key=change.get) == OUT_LINE
    assert change[D_P_LINE] < 0 and change[D_N_LINE] < 0  # the old graphs go here, not before
    assert change["loss.backward()"] < 0
    assert rows[0]["alive_bytes"] == seed["per_step"][0]["graph_bytes_alive"]
    assert rows[-1]["alive_bytes"] == timeline["alive_after_step"]
    assert timeline["alive_after_step"] == seed["graph_bytes_alive"]
    for before, after in zip(rows, rows[1:]):
        assert after["change_bytes"] == after["alive_bytes"] - before["alive_bytes"]
    held = {name for name, nbytes in timeline["held_by_variable"].items() if nbytes > 0}
    assert held == {"out_a", "out_p", "out_n", "d_p", "d_n"}
    assert timeline["held_by_variable"]["loss"] == 0  # backpropagated: freed
    assert timeline["held_by_variable"]["model.features"] == 0


# --------------------------------------------------------------------------- graph lifecycle


def test_graph_lifecycle(run):
    life = run["report"]["graph_lifecycle"]
    forward = life["forward_with_grad"]
    assert forward > 0
    assert life["after_backward_output_still_referenced"] == 0
    assert "second time" in life["second_backward_error"]
    assert life["after_del_output_without_backward"] == 0
    assert life["after_backward_retain_graph"] == forward
    assert life["after_retained_output_deleted"] == 0
    assert life["forward_no_grad"] == life["forward_inference_mode"] == 0
    # Rebinding: both graphs at once, sharing only the input images the first conv saved.
    image_bytes = T * 3 * SIZE * SIZE * 4
    assert life["rebind_without_del_peak"] == 2 * forward - image_bytes
    assert life["rebind_after_del_peak"] == forward


# --------------------------------------------------------------------------- phases and chart


def test_phases_show_what_each_loop_holds_during_a_step(run):
    variants = run["report"]["variants"]
    forwards, retained = reference_seed_graph_bytes(last_batch())
    param_bytes = variants["seed"]["param_bytes"]
    seed = {row["phase"]: row for row in variants["seed"]["phases"]}
    ours = {row["phase"]: row for row in variants["two_pass"]["phases"]}
    assert list(seed) == list(ours) == list(memory_report.SEED_PHASES)
    # The seed's mining graphs live from one step into the next, beside the new ones.
    assert (
        seed["start of step"]["graph_bytes_alive"]
        == seed["end of step"]["graph_bytes_alive"]
        == retained
    )
    assert seed["after mining forward"]["graph_bytes_alive"] == retained + forwards
    assert seed["end of step"]["grad_bytes"] == param_bytes
    # Ours: no graph before its one grad forward, none after backward, no gradient kept.
    assert ours["after training forward"]["graph_bytes_alive"] > 0
    for phase in ("start of step", "after mining forward", "after mining", "after backward"):
        assert ours[phase]["graph_bytes_alive"] == 0, phase
    assert ours["after backward"]["grad_bytes"] == param_bytes
    assert ours["end of step"]["grad_bytes"] == ours["end of step"]["graph_bytes_alive"] == 0
    assert ours["end of step"]["optimizer_state_bytes"] > 0


def test_plot_writes_a_png_of_both_loops_phases(run, tmp_path):
    with Image.open(run["plot"]) as image:
        assert image.format == "PNG" and image.width > image.height > 200
    report = run["report"]
    figure = memory_report.plot_phases(report, tmp_path / "again.png")
    assert (tmp_path / "again.png").read_bytes() == run["plot"].read_bytes()
    axes = figure.axes
    assert "seed" in axes[0].get_title() and "ours" in axes[1].get_title()
    for ax, name in zip(axes, ("seed", "two_pass")):
        phases = report["variants"][name]["phases"]
        ticks = [tick.get_text().replace("\n", " ") for tick in ax.get_xticklabels()]
        assert ticks == [row["phase"] for row in phases]
        bars = {container.get_label(): container for container in ax.containers}
        assert list(bars) == list(memory_report.HELD.values())
        for key, legend in memory_report.HELD.items():
            heights = [patch.get_height() for patch in bars[legend]]
            np.testing.assert_allclose(heights, [row[key] / 2**20 for row in phases])


# --------------------------------------------------------------------------- inputs


def test_triplet_batches_are_seeded_and_valid():
    first = memory_report.make_triplet_batches(2, 3, 8, 4, seed=1)
    again = memory_report.make_triplet_batches(2, 3, 8, 4, seed=1)
    for batch, same in zip(first, again):
        assert all(torch.equal(x, y) for x, y in zip(batch, same))
        a, p, n, label_p, label_n = batch
        assert a.shape == p.shape == n.shape == (3, 3, 8, 8)
        assert (label_p != label_n).all() and label_n.max() < 4
    assert not torch.equal(first[0][0], first[1][0])


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--steps", "1"], "--steps"),
        (["--batch-size", "0"], "--batch-size"),
        (["--batch-size", "4", "--pk", "5"], "--pk"),
        (["--num-classes", "1"], "--num-classes"),
        (["--margin", "0"], "--margin"),
        (["--margin", "nan"], "--margin"),
        (["--lr", "inf"], "--lr"),
        (["--device", "tpu"], "--device"),
        (["--device", "cpu", "--snapshot", "s.pickle"], "--snapshot"),
    ],
)
def test_bad_input_names_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit):
        memory_report.parse_args(argv)
    assert flag in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")
def test_cuda_without_cuda_is_a_clear_error(capsys):
    with pytest.raises(SystemExit):
        memory_report.parse_args(["--device", "cuda"])
    assert "no CUDA device is available" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--json", "--snapshot", "--plot"])
def test_an_output_that_cannot_be_written_is_refused_before_the_report(tmp_path, capsys, flag):
    (tmp_path / "file").write_text("")
    for bad, why in ((tmp_path, "is a folder"), (tmp_path / "file" / "r", "cannot write")):
        with pytest.raises(SystemExit) as exit_info:
            memory_report.parse_args([flag, str(bad)])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and flag in err and f"{bad}: {why}" in err, err


def test_threads_must_be_positive(capsys):
    with pytest.raises(SystemExit) as exit_info:
        memory_report.parse_args(["--threads", "0"])
    assert exit_info.value.code == 2 and "--threads" in capsys.readouterr().err


def test_image_size_takes_one_side_or_height_x_width():
    assert memory_report.image_size_arg("64") == 64
    assert memory_report.image_size_arg("112x96") == [112, 96]
    assert memory_report.image_size_arg("32x32") == 32  # square: one side, as a config stores it
    for bad in ("0", "112x", "1x2x3", "a"):
        with pytest.raises(Exception, match="positive integer or HxW"):
            memory_report.image_size_arg(bad)
    batches = memory_report.make_triplet_batches(1, 2, [24, 20], 3, seed=0)
    assert batches[0][0].shape == (2, 3, 24, 20)  # (T, 3, H, W)


def test_a_non_square_report_runs(tmp_path):
    argv = [*ARGV[:3], "24x20", *ARGV[4:], "--json", str(tmp_path / "r.json")]
    memory_report.main(argv)
    assert json.loads((tmp_path / "r.json").read_text())["config"]["image_size"] == [24, 20]


def test_without_json_the_report_goes_to_stdout_and_progress_to_stderr(capsys):
    report = memory_report.main([*ARGV, "--pk", "0", "--steps", "2"])
    captured = capsys.readouterr()
    assert json.loads(captured.out) == json.loads(json.dumps(report))
    measured = ["seed loop, 2 steps", "two_pass, 2 steps", "one_pass, 2 steps", "graph lifecycle"]
    assert captured.err.splitlines() == [f"memory report: {line}" for line in measured]
