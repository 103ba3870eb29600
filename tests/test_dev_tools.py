"""The developer tools of dev/ without a GPU: cubin_diff on fake builds, gpu_check's options,
result parsing and summary on canned pytest reports, build_cubins' options and configuration
set."""

from __future__ import annotations

import gzip
import itertools
import json
import pathlib
import subprocess
import sys

import pytest

import gpu

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "dev"))

import build_cubins  # noqa: E402
import cubin_diff  # noqa: E402
import gpu_check  # noqa: E402

# ----------------------------------------------------------------------------- cubin_diff


def _image(folder, name, cubin: bytes, packed=False, **meta):
    folder.mkdir(parents=True, exist_ok=True)
    if packed:
        (folder / f"{name}.cubin.gz").write_bytes(gzip.compress(cubin))
    else:
        (folder / f"{name}.cubin").write_bytes(cubin)
    m = dict(kernel=name, entry=f"{name}_entry", params=[["rows", "i32"]], block=512, smem=1024,
             config=dict(world=8, topk=2048, local_topk=512), arch="sm_90a", source_hash="x" * 64,
             grid="doc", cubin=f"{name}.cubin", ptx=f"{name}.ptx", compile_seconds=1.0)  # fmt: skip
    m.update(meta)
    (folder / f"{name}.json").write_text(json.dumps(m))


def _build(root, shash, packed=False, merge=b"merge", smem=1024, extra=()):
    for tag in ("sm_90a-w8-k2048-n512", "sm_90a-w8-k2048-n512-rl") + tuple(extra):
        d = root / f"{tag}-{shash}"
        _image(d, "select_push", b"select " + tag.encode(), packed=packed, source_hash=shash * 4)
        _image(d, "merge", merge, packed=packed, smem=smem, source_hash=shash * 4, compile_seconds=2.5)
    return root


def _diff(*argv):
    r = subprocess.run([sys.executable, str(REPO / "dev" / "cubin_diff.py"), *map(str, argv)],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    return r.returncode, r.stdout + r.stderr


def test_identical_builds_whatever_the_hash_and_packing(tmp_path):
    a = _build(tmp_path / "a", "a" * 16)
    b = _build(tmp_path / "b", "b" * 16, packed=True)
    rc, out = _diff(a, b)
    assert rc == 0 and out.strip().endswith("4 identical, 0 different, 0 missing"), out


def test_a_different_cubin_or_metadata_is_named(tmp_path):
    a = _build(tmp_path / "a", "a" * 16, merge=b"merge v2")
    b = _build(tmp_path / "b", "b" * 16)
    rc, out = _diff(a, b)
    assert rc == 1 and "DIFFERENT sm_90a-w8-k2048-n512 merge: cubin bytes (8 vs 5 bytes)" in out, out
    assert "2 identical, 2 different, 0 missing" in out, out
    c = _build(tmp_path / "c", "c" * 16, smem=2048)
    rc, out = _diff(c, b)
    assert rc == 1 and "smem: 2048 vs 1024" in out, out


def test_missing_configurations_and_images(tmp_path):
    a = _build(tmp_path / "a", "a" * 16, extra=("sm_90a-w16-k2048-n1024",))
    b = _build(tmp_path / "b", "b" * 16)
    rc, out = _diff(a, b)
    assert rc == 1 and "MISSING sm_90a-w16-k2048-n1024: not in OLD" in out and "4 identical, 0 different, 1 missing" in out
    rc, out = _diff(b, a)  # OLD may hold more configurations ...
    assert rc == 0, out
    rc, out = _diff(b, a, "--both-ways")  # ... unless both ways are asked for
    assert rc == 1 and "not in NEW" in out, out
    _image(a / f"sm_90a-w8-k2048-n512-{'a' * 16}", "merge_wide", b"wide")
    rc, out = _diff(a, b, "--quiet")
    assert rc == 1 and out.count("\n") == 1 and "1 different" in out, out


def test_two_builds_of_one_configuration_are_ambiguous(tmp_path):
    a = _build(tmp_path / "a", "a" * 16)
    b = _build(_build(tmp_path / "b", "b" * 16), "c" * 16)
    rc, out = _diff(a, b)
    assert rc == 1 and "AMBIGUOUS sm_90a-w8-k2048-n512: 2 builds in OLD" in out, out


def test_usage_errors(tmp_path):
    rc, out = _diff(tmp_path / "none", tmp_path)
    assert rc == 2 and "not a folder" in out
    (tmp_path / "empty").mkdir()
    rc, out = _diff(tmp_path / "empty", tmp_path)
    assert rc == 1 and "no configuration folder" in out


def test_the_tag_is_the_cache_s():
    from jax_dsa_exchange.kernels import cache

    for rl in (False, True):
        tag = cache.config_tag("sm_90a", 16, 4096, 2048, "0123456789abcdef" * 4, rl)
        m = cubin_diff.TAG.match(tag)
        assert m and m.group("hash") == "0123456789abcdef" and tag.startswith(m.group("config") + "-")


# ----------------------------------------------------------------------------- gpu_check

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="1" failures="1" skipped="3" tests="7" time="12.3">
<testcase classname="tests.test_kernels_gpu" name="test_a[8-2048-512]" time="0.5"/>
<testcase classname="tests.test_kernels_gpu" name="test_a[16-2048-1024]" time="0.5"/>
<testcase classname="tests.test_kernels_gpu" name="test_b" time="0.1"><failure message="assert 1 == 2">x</failure></testcase>
<testcase classname="tests.test_kernels_gpu" name="test_c[8-2048-512]" time="0.0">
  <skipped type="pytest.skip" message="W=8 N=512: this build's merge is not clustered">s</skipped></testcase>
<testcase classname="tests.test_select_gpu.TestSplit" name="test_d" time="0.2"><error message="fixture">e</error></testcase>
<testcase classname="tests.test_op_gpu" name="test_e" time="0.0">
  <skipped type="pytest.xfail" message="jax 0.11.2: the gate">x</skipped></testcase>
<testcase classname="tests.test_op_gpu" name="test_f" time="0.0">
  <skipped type="pytest.skip" message="no GPU backend in jax (jax.default_backend() == 'cpu'); install">s</skipped></testcase>
</testsuite></testsuites>
"""


def test_junit_counts_per_test_file():
    c = gpu_check.junit_counts(JUNIT)
    assert set(c) == {"tests/test_kernels_gpu.py", "tests/test_select_gpu.py", "tests/test_op_gpu.py"}
    k = c["tests/test_kernels_gpu.py"]
    assert (k.passed, k.failed, k.errors, k.skipped, k.xfailed, k.stack_skips) == (2, 1, 0, 1, 0, 0)
    s = c["tests/test_select_gpu.py"]
    assert (s.passed, s.errors) == (0, 1)
    o = c["tests/test_op_gpu.py"]
    assert (o.skipped, o.xfailed, o.stack_skips) == (1, 1, 1)


def _result(rc, log="", xml=None, **run):
    run = gpu_check.Run("r", ["x"], **run)
    return gpu_check.judge(gpu_check.Result("tests", "r", rc, 1.0, "r.log"), run, log, xml)


def test_judge_and_summary():
    ok_xml = JUNIT.replace("<failure", "<!--").replace("</failure>", "-->")
    r = _result(1, xml=JUNIT, pytest=True)
    assert r.why == ["exit status 1", "1 test(s) skipped for a missing piece of the GPU stack"]
    # a skip for a configuration this node cannot hold is no failure, an xfail neither
    good = JUNIT.split('<testcase classname="tests.test_select_gpu')[0] + "</testsuite></testsuites>"
    assert _result(0, xml=good.replace("<failure", "<!--").replace("</failure>", "-->"), pytest=True).ok
    assert not _result(0, xml=ok_xml, pytest=True).ok  # (the stack skip of test_f)
    stopped = _result(4, log="\nno tests ran in 0.01s\nERROR: --require-gpu: 3 selected GPU test(s) cannot run "
                               "here, the GPU stack is incomplete:\n  - no NVIDIA GPU (nvidia-smi is not on "
                               "PATH); run on a node\n\n", pytest=True)  # fmt: skip
    assert stopped.why[0] == "exit status 4" and stopped.why[1].startswith("--require-gpu: 3 selected")
    assert "no NVIDIA GPU" in stopped.why[1] and len(stopped.why) == 2
    assert _result(0, xml='<testsuites><testsuite tests="0"></testsuite></testsuites>', pytest=True).why == ["no test ran"]
    assert _result(None).why == ["time limit"]
    assert _result(0).ok and _result(0, pytest=True).why == ["no JUnit XML written"]
    assert _result(0, log="========= ERROR SUMMARY: 0 errors\n", sanitizer=True).ok
    assert _result(99, log="========= ERROR SUMMARY: 3 errors\n", sanitizer=True).why == [
        "exit status 99", "compute-sanitizer: 3 error(s)"]
    race = "========= RACECHECK SUMMARY: 2 hazards displayed (1 error, 1 warning)\n"
    assert _result(0, log=race, sanitizer=True).why == ["compute-sanitizer: 1 error(s)"]
    assert _result(0, log="", sanitizer=True).why == ["no compute-sanitizer summary in the log"]
    text = gpu_check.summary([r, _result(0)])
    assert "tests/r" in text and "FAILED" in text and "1 of 2 runs passed: FAILED" in text
    row = next(line for line in text.splitlines() if "tests/test_kernels_gpu.py" in line)
    assert row.split()[1:] == ["2", "1", "0", "1", "0"]


def test_stack_skips_are_tests_gpu_messages(monkeypatch):
    """Every reason tests/gpu.py gives for a missing piece starts as the runner expects."""
    monkeypatch.setattr(gpu.shutil, "which", lambda name: None)
    monkeypatch.setitem(sys.modules, "cupy", None)
    monkeypatch.setenv("JAX_DSA_EXCHANGE_CUBIN_DIR", "/nonexistent")
    from jax_dsa_exchange import _ffi
    from jax_dsa_exchange.kernels import cache

    monkeypatch.setattr(_ffi, "available", lambda: False)
    monkeypatch.setattr(cache, "cutlass_available", lambda: False)
    monkeypatch.setattr(cache, "user_cache_dir", lambda: pathlib.Path("/nonexistent"))
    for piece, check in gpu.PIECES.items():
        why = check()
        if piece == "jax" and why is None:
            continue  # (a GPU node: its jax has the backend)
        assert why and why.startswith(gpu_check.STACK_SKIPS), (piece, why)
    monkeypatch.setattr(_ffi, "available", lambda: True)
    monkeypatch.setattr(_ffi, "driver_available", lambda: False)
    assert gpu.PIECES["driver"]().startswith(gpu_check.STACK_SKIPS)


def test_gpu_check_options():
    a = gpu_check.parse_args([])
    assert a.steps == gpu_check.DEFAULT == ["tests", "launcher", "ops", "demo"]
    a = gpu_check.parse_args(["all", "tests", "long", "--out", "/tmp/x", "--limit", "2"])
    assert a.steps == gpu_check.ALL + ["long"] and a.out == "/tmp/x" and a.limit == 2
    for bad in (["nosuchstep"], ["--limit", "0"]):
        with pytest.raises(SystemExit) as e:
            gpu_check.parse_args(bad)
        assert e.value.code == 2
    known = gpu_check.steps(gpu_check.parse_args([]))
    assert set(gpu_check.ALL) <= set(known) and {"tests", "ops", "demo", "bench", "sanitize", "serving"} <= set(known)
    for s in known.values():
        for run in s.runs:
            if run.pytest:
                assert "--require-gpu" in run.argv, (s.name, run.name)
    kinds = [run.env.get("JAX_DSA_EXCHANGE_TEST_RESCUE_LIST") for run in known["tests"].runs]
    assert kinds == ["0", "1"]
    assert known["ops"].mps and not known["sanitize"].mps
    bench = gpu_check.steps(gpu_check.parse_args(["bench", "--baseline-cubins", "old"]))["bench"].runs[0].argv
    assert bench[bench.index("--baseline-cubins") + 1] == "old" and "--csv" in bench


def test_gpu_check_lists_and_dry_runs():
    r = subprocess.run([sys.executable, str(REPO / "dev" / "gpu_check.py"), "--dry-run", "tests", "demo"],
                       capture_output=True, text=True, timeout=60, cwd=REPO)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "JAX_DSA_EXCHANGE_TEST_RESCUE_LIST=1" in r.stdout and "jax_dsa_exchange.demo --path ffi" in r.stdout
    r = subprocess.run([sys.executable, str(REPO / "dev" / "gpu_check.py"), "--list"], capture_output=True,
                       text=True, timeout=60, cwd=REPO)  # fmt: skip
    assert r.returncode == 0 and all(f"\n{s}" in "\n" + r.stdout for s in gpu_check.ALL), r.stdout


# ----------------------------------------------------------------------------- build_cubins


def test_build_set_covers_the_gpu_tests():
    """Every (W, K, N) and (W, K, N, I) the GPU kernel tests use is in the build set, with both
    kinds."""
    import test_kernels_gpu

    built = {}
    for worlds, topks, ns, kinds, *rest in build_cubins.CONFIGS:
        for w, k, n, i in itertools.product(worlds, topks, ns, rest[0] if rest else (1,)):
            if n <= k:
                built.setdefault((w, k, n, i), set()).update({"default", "rl"} if kinds == "both" else {"default"})
    for cfg in test_kernels_gpu.CONFIGS:
        assert built.get(cfg + (1,)) == {"default", "rl"}, cfg
    for cfg in test_kernels_gpu.INTERLEAVED:
        assert built.get(cfg) == {"default", "rl"}, cfg
    argv = build_cubins.build_argv("py", build_cubins.CONFIGS[-2], "/o")
    assert argv[-3:] == ["--interleave", "3", "--both"], argv
    argv = build_cubins.build_argv("py", build_cubins.CONFIGS[0], "/o")
    assert argv[:3] == ["py", "-m", "jax_dsa_exchange.build"] and argv[-1] == "--both" and "/o" in argv


def test_build_cubins_options(tmp_path):
    assert build_cubins.pinned_jaxlib() == "0.11.2" or build_cubins.pinned_jaxlib().count(".") == 2
    a = build_cubins.parse_args(["--quick", "--jobs", "2", "--no-ffi"])
    assert a.quick and a.jobs == 2 and a.no_ffi
    for bad in (["--jobs", "0"], ["--no-ffi", "--no-cubins"], ["--ffi-include", str(tmp_path)]):
        with pytest.raises(SystemExit) as e:
            build_cubins.parse_args(bad)
        assert e.value.code == 2
    (tmp_path / "pyproject.toml").write_text('[build-system]\nrequires = ["a", "jaxlib==0.13.1"]\n\n[project]\n'
                                             'dependencies = ["jaxlib==9.9"]\n')  # fmt: skip
    assert build_cubins.pinned_jaxlib(tmp_path / "pyproject.toml") == "0.13.1"


def test_wheel_include(tmp_path):
    import zipfile

    whl = tmp_path / "jaxlib-0.11.2-cp312-cp312-manylinux2014_x86_64.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr("jaxlib/include/xla/ffi/api/ffi.h", "// ffi")
        z.writestr("jaxlib/xla_extension.so", "binary")
    inc = build_cubins.wheel_include(whl, tmp_path / "out")
    assert (inc / "xla" / "ffi" / "api" / "ffi.h").read_text() == "// ffi"
    assert not (tmp_path / "out" / "jaxlib" / "xla_extension.so").exists()
