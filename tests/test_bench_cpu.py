"""benchmarks.bench_cpu_kernel end to end on a few synthetic "LFW" photos (--quick)."""

import json

import numpy as np
import pytest
from PIL import Image

from benchmarks import bench_cpu_kernel


def _fake_lfw(root):
    """lfw_pairs.txt (1 fold: 2 same, 2 different pairs) over 3 identities' noise photos."""
    rng = np.random.default_rng(0)
    for name in ("Ann", "Bob", "Cid"):
        (root / "lfw_pairs_150" / name).mkdir(parents=True)
        for i in (1, 2):
            pixels = rng.integers(0, 256, (150, 150, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / "lfw_pairs_150" / name / f"{name}_000{i}.jpg")
    lines = ["1 2", "Ann 1 2", "Bob 1 2", "Ann 1 Bob 2", "Bob 1 Cid 2"]
    (root / "lfw_pairs.txt").write_text("\n".join(lines) + "\n")


def test_quick_run_measures_every_task_in_both_modes(tmp_path):
    _fake_lfw(tmp_path)
    report_path = tmp_path / "cpu.json"
    assert (
        bench_cpu_kernel.main(["--lfw", str(tmp_path), "--quick", "--json", str(report_path)]) == 0
    )
    report = json.loads(report_path.read_text())
    rows = {(row["task"], row["mode"]): row for row in report["rows"]}
    assert set(rows) == {(t, m) for t in bench_cpu_kernel.TASKS for m in bench_cpu_kernel.MODES}
    assert rows["evaluation", "keep"]["images"] == 2 * 5  # 5 unique photos and their mirrors
    for row in rows.values():
        assert row["cpu_ms_per_image"] > 0 and 0 <= row["system_share"] <= 1
    assert not rows["bare_forward", "system"]["malloc_set_up"]
    assert report["summary"]["evaluation_over_forward_keep"] > 0


def test_a_missing_lfw_folder_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        bench_cpu_kernel.main(["--lfw", str(tmp_path / "absent")])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.count("\n") == 1
