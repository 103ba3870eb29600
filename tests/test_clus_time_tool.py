"""tools/clus_time.py's launcher rows (pure Python; the timing itself needs a GPU): each
merge_wide variant is paired with the merge of the same configuration and tune,
and takes the rows up to its measured fit."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "tools"), ROOT]

import clus_time  # noqa: E402


def test_launcher_rows_pair_each_wide_image_with_its_merge():
    rows = [1, 16, 32, 64]
    names = [v[0] for v in clus_time.VARIANTS]
    res = {n: {f"r{R}": (float(i * 100 + R), 0.0) for R in rows} for i, n in enumerate(names)}
    fit = {"w16 merge_wide": 30, "w8n1024 merge_wide": 62}
    lines = clus_time.launcher_rows(res, fit, rows)
    assert len(lines) == 2 and lines[0].endswith("else w16 merge") and lines[1].endswith("else w8n1024 merge")
    at = lambda name, R: res[name][f"r{R}"]  # noqa: E731
    assert at("w16 merge_wide launcher", 16) == at("w16 merge_wide", 16)
    assert at("w16 merge_wide launcher", 64) == at("w16 merge", 64)  # 64 > its fit: the merge
    assert at("w8n1024 merge_wide launcher", 32) == at("w8n1024 merge_wide", 32)  # 32 <= 62
    assert at("w8n1024 merge_wide launcher", 64) == at("w8n1024 merge", 64)  # (not its clus=0 variant)
    lines = clus_time.launcher_rows(res, {"w16 wide runs=0": 30}, rows)  # (paired by tune too)
    assert lines[0].endswith("else w16 runs=0")
    assert at("w16 wide runs=0 launcher", 64) == at("w16 runs=0", 64)
    # a wide variant whose merge was not timed: an empty row, no error
    del res["w16 merge"]
    clus_time.launcher_rows(res, {"w16 merge_wide": 30}, rows)
    assert set(res["w16 merge_wide launcher"]) == {"cluster"}
