"""benchmarks/bench_kernels.py without a GPU: its options, its stamped CSV, and how it finds
the baseline build's images (the timing itself needs a GPU)."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

from jax_dsa_exchange.kernels import abi, cache
from jax_dsa_exchange.testing.timing import prebuilt_images

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_kernels as bk  # noqa: E402


def test_help_runs_without_a_gpu():
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_kernels.py"), "--help"],
                       capture_output=True, text=True, timeout=120, cwd=REPO)  # fmt: skip
    assert r.returncode == 0, r.stderr
    for opt in ("--baseline-cubins", "--csv", "--tables", "--no-torch"):
        assert opt in r.stdout


def test_defaults_are_the_reference_grid():
    a = bk.parse_args([])
    assert (a.world, a.topk, a.n, a.rows, a.cols) == (8, 2048, [256, 512, 1024], [1, 16, 64, 256],
                                                      [8192, 32768, 131072])  # fmt: skip
    assert a.tables == ["producer", "merge"] and a.baseline_cubins is None and a.csv is None


def test_options_parse(tmp_path):
    a = bk.parse_args(["--tables", "merge", "pair", "--n", "512", "--rows", "1", "64", "--baseline-cubins",
                       str(tmp_path), "--csv", str(tmp_path / "k.csv"), "--no-torch", "--no-jax"])  # fmt: skip
    assert a.tables == ["merge", "pair"] and a.n == [512] and a.rows == [1, 64]
    assert a.baseline_cubins == tmp_path and not a.torch and a.no_jax


@pytest.mark.parametrize("argv,what", [
    (["--n", "100"], "local_topk=100"), (["--world", "17"], "world=17"), (["--rows", "0"], "positive"),
    (["--tables", "grid"], "invalid choice"), (["--baseline-cubins", "/nonexistent/dir"], "not a folder"),
])  # fmt: skip
def test_bad_options_name_the_value(argv, what, capsys):
    with pytest.raises(SystemExit) as e:
        bk.parse_args(argv)
    assert e.value.code == 2
    assert what in capsys.readouterr().err


def test_columns_follow_what_is_measured(tmp_path):
    names = ["N", "select_push_us", "select_push_kernel_us", "base_select_push_us", "select_push_ratio",
             "torch_topk_us", "jax_top_k_us", "merge_rescue_us", "rescued_rows", "pair_pdl_span_us"]  # fmt: skip
    a = bk.parse_args(["--no-torch", "--no-rescue"])
    assert bk.columns(a, names) == ["N", "select_push_us", "jax_top_k_us"]
    a = bk.parse_args(["--no-jax", "--baseline-cubins", str(tmp_path)])
    a.torch = True
    assert bk.columns(a, names) == [n for n in names if n != "jax_top_k_us"]


def test_csv_is_stamped_then_a_header():
    st = bk.stamp(["python", "benchmarks/bench_kernels.py", "--csv", "a b.csv"], "NVIDIA H200", "570.86.15")
    text = bk.csv_text(st, ["N", "R", "merge_us"], [dict(N=512, R=1, merge_us=3.14159), dict(N=512, R=16)])
    lines = text.splitlines()
    assert [ln.split(":")[0] for ln in lines[:6]] == [f"# {k}" for k in bk.STAMP_KEYS]
    assert lines[0] == "# gpu: NVIDIA H200" and lines[1] == "# driver: 570.86.15"
    assert re.fullmatch(r"# jax: \d+\.\d+.*", lines[2])
    assert re.fullmatch(r"# commit: ([0-9a-f]{40}( \(with uncommitted changes\))?|unknown)", lines[3]), lines[3]
    assert re.fullmatch(r"# date: \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC", lines[4])
    assert lines[5] == "# command: python benchmarks/bench_kernels.py --csv 'a b.csv'"
    assert lines[6:] == ["N,R,merge_us", "512,1,3.142", "512,16,"]
    assert bk.csv_path(pathlib.Path("docs/perf/kernels.csv"), "merge") == pathlib.Path("docs/perf/kernels_merge.csv")


def _fake_build(folder, world, topk, n, shash, rescue_list=False):
    imgs = {}
    for name in ("select_push", "merge"):
        k = abi.KERNELS[name]
        imgs[name] = cache.KernelImage(
            kernel=name, entry=f"{name}_entry", cubin=f"{name} {shash}".encode(), ptx="// ptx",
            block=512, smem=1024, params=k.pairs(),
            config=dict(world=world, topk=topk, local_topk=n, rescue_list=rescue_list),
            arch="sm_90a", source_hash=shash)  # fmt: skip
    return cache.write_images(imgs, folder)


def test_baseline_images_of_the_same_configuration_whatever_the_hash(tmp_path):
    _fake_build(tmp_path, 8, 2048, 512, "a" * 64)
    _fake_build(tmp_path, 8, 2048, 1024, "b" * 64)
    _fake_build(tmp_path, 8, 2048, 512, "c" * 64, rescue_list=True)
    imgs = prebuilt_images(tmp_path, 8, 2048, 512)
    assert imgs["merge"].cubin == b"merge " + b"a" * 64 and imgs["select_push"].source_hash == "a" * 64
    assert prebuilt_images(tmp_path, 8, 2048, 512, rescue_list=True)["merge"].source_hash == "c" * 64
    with pytest.raises(FileNotFoundError, match="no build of sm_90a-w16-k2048-n512-"):
        prebuilt_images(tmp_path, 16, 2048, 512)
    _fake_build(tmp_path, 8, 2048, 512, "d" * 64)
    with pytest.raises(FileNotFoundError, match="2 builds"):
        prebuilt_images(tmp_path, 8, 2048, 512)


def test_baseline_of_another_abi_is_refused(tmp_path):
    d = _fake_build(tmp_path, 8, 2048, 512, "a" * 64)
    meta = (d / "merge.json").read_text().replace('"rows"', '"nrows"')
    (d / "merge.json").write_text(meta)
    with pytest.raises(ValueError, match="another kernel ABI"):
        prebuilt_images(tmp_path, 8, 2048, 512)
