"""``pytest --require-gpu`` (tests/conftest.py, tests/gpu.py): a GPU test that would skip for a
missing piece of the GPU stack stops the run before any test runs, with one message naming what
is missing; without the option those tests skip; skips for other reasons stay skips, listed.

Each case runs pytest in a fresh process.  Pieces are hidden through a plugin that replaces their
checks (``gpu.PIECES``), and ``JAX_PLATFORMS=cpu`` takes jax's GPU backend away, so that the
cases hold on any machine, a GPU node included."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

import gpu

REPO = pathlib.Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"

PLUGIN = '''
import os
import gpu

for _p in filter(None, os.environ.get("HIDE_PIECES", "").split(",")):
    gpu.PIECES[_p] = (lambda p=_p: f"{p} hidden by the test")
for _p in filter(None, os.environ.get("SHOW_PIECES", "").split(",")):
    gpu.PIECES[_p] = lambda: None
'''


def _pytest(args, cwd, tmp_path, hide=(), show=(), env=None):
    (tmp_path / "hide_pieces.py").write_text(PLUGIN)
    e = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(TESTS), str(REPO)]),
             HIDE_PIECES=",".join(hide), SHOW_PIECES=",".join(show), **(env or {}))  # fmt: skip
    e.pop("PYTEST_ADDOPTS", None)
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "hide_pieces", "-p", "no:cacheprovider", *args],
                       cwd=cwd, env=e, capture_output=True, text=True, timeout=600)  # fmt: skip
    return r.returncode, r.stdout + r.stderr


def test_the_suite_stops_without_a_gpu_backend_in_jax(tmp_path):
    """`pytest -m gpu --require-gpu` on a machine without a GPU backend in jax: non-zero, one message
    naming it and its fix, no test run."""
    rc, out = _pytest(["-q", "-m", "gpu", "--require-gpu"], REPO, tmp_path, env={"JAX_PLATFORMS": "cpu"})
    assert rc == 4, out
    assert out.count("--require-gpu:") == 1, out
    assert "no GPU backend in jax (jax.default_backend() == 'cpu'); install the cuda13 extra" in out, out
    for word in ("passed", "failed", "PASSED", "FAILED"):
        assert word not in out, out


def test_the_suite_skips_gpu_tests_by_default(tmp_path):
    """Without the option the same selection skips (exit 0), each skip naming the missing piece."""
    rc, out = _pytest(["-q", "-m", "gpu", "-rs"], REPO, tmp_path, hide=["gpu"])
    assert rc == 0, out
    assert " skipped" in out and "failed" not in out and "passed" not in out, out
    assert "gpu hidden by the test" in out, out


def _sandbox(tmp_path) -> pathlib.Path:
    """A folder with the project's conftest and gpu.py and three tests."""
    d = tmp_path / "suite"
    d.mkdir()
    for f in ("conftest.py", "gpu.py"):
        shutil.copy(TESTS / f, d / f)
    (d / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: needs a GPU\n")
    (d / "test_some.py").write_text('''
import pytest
from gpu import requires

@pytest.mark.gpu
@requires("gpu", "cupy")
def test_kernel():
    pass

@pytest.mark.gpu
def test_sixteen_gpus():
    pytest.skip("W = 16 GPUs: this node has fewer")

def test_cpu():
    pass

def test_also_cpu():
    pass
''')
    return d


def test_missing_pieces_named_once_in_one_message(tmp_path):
    d = _sandbox(tmp_path)
    rc, out = _pytest(["-q", "--require-gpu"], d, tmp_path, hide=["gpu", "cupy"])
    assert rc == 4, out
    assert out.count("--require-gpu:") == 1 and "2 selected GPU test(s) cannot run here" in out, out
    assert "gpu hidden by the test" in out and "cupy hidden by the test" in out, out
    assert "passed" not in out, out  # (before any test ran: not even the CPU ones)
    # a selection without the GPU test needs no GPU stack
    rc, out = _pytest(["-q", "--require-gpu", "-k", "cpu"], d, tmp_path, hide=["gpu", "cupy"])
    assert rc == 0 and "2 passed" in out, out


def test_default_run_skips_naming_the_first_missing_piece(tmp_path):
    d = _sandbox(tmp_path)
    rc, out = _pytest(["-q", "-rs"], d, tmp_path, hide=["cupy"], show=["gpu"])
    assert rc == 0 and "2 passed, 2 skipped" in out, out
    assert "cupy hidden by the test" in out and "W = 16 GPUs: this node has fewer" in out, out


def test_complete_stack_runs_and_lists_the_other_skips(tmp_path):
    """With every piece there, --require-gpu runs the GPU test; the skip for a configuration
    this node cannot hold stays a skip and is listed by its reason."""
    d = _sandbox(tmp_path)
    rc, out = _pytest(["-q", "--require-gpu"], d, tmp_path, show=["gpu", "cupy"])
    assert rc == 0 and "3 passed, 1 skipped" in out, out
    assert "SKIPPED [1]" in out and "W = 16 GPUs: this node has fewer" in out, out


def test_unknown_piece_is_an_error():
    with pytest.raises(ValueError, match="'cuda'"):
        gpu.requires("cuda")
    with pytest.raises(ValueError, match="expected some of"):
        gpu.requires()
