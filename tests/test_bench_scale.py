"""benchmarks/bench_scale.py on a few hundred images: every run measured in its own process,
the folder's second start reusing the index the first built, the figures in range."""

import json

from benchmarks import bench_scale


def test_scale_benchmark_measures_each_source_on_the_same_images(tmp_path):
    out = tmp_path / "scale.json"
    argv = ["--images", "340", "--batches", "2", "--workers", "2", "--p", "4", "--k", "2"]
    results = bench_scale.main([*argv, "--work", str(tmp_path / "sets"), "--json", str(out)])
    assert json.loads(out.read_text()) == results
    runs = [results[run] for run in bench_scale.RUNS]
    assert [run["images"] for run in runs] == [340] * 3  # 5 identities of 68
    assert [run["index_reused"] for run in runs] == [None, False, True]
    for run in runs:
        assert 0 < run["start_cpu_s"] and 0 < run["start_s"] < 60 and run["images_per_s"] > 0
        assert run["baseline_rss_mib"] <= run["steady_rss_mib"] <= run["peak_rss_mib"]
        assert run["bytes_per_image"] <= 64
        assert run["start_s_Glint360K"] > run["start_s_MS1MV2"] > run["start_s"]
    assert runs[0]["bytes_per_image"] == 32  # key, offset, label, triplet label
    assert runs[1]["bytes_per_image"] == len("000000.jpg\0") + 24
