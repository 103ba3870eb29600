"""The suite's progress lines (tests/compile_progress.py): a kernel compile and a long test
say so while they run, through pytest's output capture, in a pytest run of their own."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

TESTS = pathlib.Path(__file__).resolve().parent
ROOT = TESTS.parent


def _pytest(tmp_path, test_code: str, **env_vars) -> subprocess.CompletedProcess:
    (tmp_path / "conftest.py").write_text("from compile_progress import pytest_sessionstart  # noqa: F401\n")
    (tmp_path / "test_inner.py").write_text(textwrap.dedent(test_code))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(TESTS)]), **env_vars)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir",
                           str(tmp_path), str(tmp_path)], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)


def test_a_kernel_compile_and_a_long_test_show_progress(tmp_path):
    r = _pytest(tmp_path, """
        import time
        from jax_dsa_exchange.kernels import cache

        class FakeKernel:  # compiles in 0.2 s, no CuTe DSL needed
            def compile(self, arch, dump_dir):
                time.sleep(0.2)
                return object()

        def test_compile(monkeypatch):
            monkeypatch.setattr(cache, "_kernel_object", lambda *a, **k: FakeKernel())
            print("CAPTURED OUTPUT")  # the test's own output stays captured
            cache.compile_kernel("merge", "sm_90a", 3, 96, 64)
            cache.compile_kernel("merge", "sm_90a", 3, 96, 64)  # cached: no second line

        def test_long():
            time.sleep(3.5)
    """, DSA_TEST_HEARTBEAT_S="1")
    out = r.stdout
    assert r.returncode == 0, out + r.stderr
    assert out.count("compiling kernels W=3 K=96 N=64 (1 of 1: merge)") == 1, out
    assert "compiled merge W=3 K=96 N=64 in 0." in out, out
    assert "CAPTURED OUTPUT" not in out, out
    assert len(re.findall(r"^test_inner.py::test_long: still running after \d+ s$", out, re.M)) >= 2, out
    assert "test_compile: still running" not in out, out


def test_compile_images_counts_its_kernels(tmp_path):
    from jax_dsa_exchange.kernels import cache

    if not cache.cutlass_available():
        pytest.skip("nvidia-cutlass-dsl (CuTe DSL) is not installed")
    r = _pytest(tmp_path, """
        from jax_dsa_exchange.kernels import cache

        def test_images():
            names = list(cache.compile_images("sm_90a", 1, 64, 32))
            print("NAMES", names)
            assert names[0] == "select_push" and names[-1] == "merge"
    """)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [line for line in r.stdout.splitlines() if line.startswith("compiling kernels")]
    m = len(lines)
    assert m >= 2, r.stdout
    assert lines[0] == f"compiling kernels W=1 K=64 N=32 (1 of {m}: select_push)", r.stdout
    assert lines[-1] == f"compiling kernels W=1 K=64 N=32 ({m} of {m}: merge)", r.stdout
