"""The pieces of the GPU stack the GPU tests need, checked in one place.

A GPU test names what it needs with a mark from :func:`requires` (``gpu``, ``jax``, ``cupy``,
``ffi``, ``driver``, ``nvcc``, ``cubins``: :data:`PIECES`).  tests/conftest.py reads the marks
after collection: by default a test whose piece is missing skips, naming it; under
``pytest --require-gpu`` the run stops before any test runs, with one message naming every
missing piece a selected test needs and how to install it.  Skips for a reason that holds on any
machine (a configuration this build or this hardware does not have) are ordinary skips in the
tests and stay skips.
"""

from __future__ import annotations

import functools
import shutil
import subprocess

import pytest

MARK = "gpu_stack"


@functools.cache
def gpu_count() -> int:
    """NVIDIA GPUs that ``nvidia-smi -L`` lists (0 without nvidia-smi)."""
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def _gpu() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return "no NVIDIA GPU (nvidia-smi is not on PATH); run on a node with an NVIDIA GPU and its driver"
    if gpu_count() == 0:
        return "no NVIDIA GPU (nvidia-smi -L lists none); run on a node with an NVIDIA GPU and its driver"
    return None


def _jax() -> str | None:
    try:
        import jax

        backend = jax.default_backend()
    except Exception as e:  # noqa: BLE001 - any failure to start a backend is the answer
        return f"jax cannot start a backend ({type(e).__name__}: {e}); install the cuda13 extra: pip install -e '.[cuda13,test]'"
    if backend != "gpu":
        return (f"no GPU backend in jax (jax.default_backend() == {backend!r}); install the cuda13 extra: "
                f"pip install -e '.[cuda13,test]' (or cuda12)")  # fmt: skip
    return None


def _cupy() -> str | None:
    try:
        import cupy  # noqa: F401
    except Exception as e:  # noqa: BLE001 - an ImportError or a broken CUDA install alike
        return (f"CuPy is not importable ({type(e).__name__}: {e}); install the cuda13 extra "
                f"(cupy-cuda13x) or the cuda12 one (cupy-cuda12x)")  # fmt: skip
    return None


def _ffi_lib() -> str | None:
    from jax_dsa_exchange import _ffi

    if not _ffi.available():
        return (f"the FFI launcher library is not loadable: {_ffi.load_error()} "
                f"(or: python dev/build_cubins.py, which writes build/ffi_lib)")  # fmt: skip
    return None


def _driver() -> str | None:
    from jax_dsa_exchange import _ffi

    why = _ffi_lib()
    if why:
        return why
    if not _ffi.driver_available():
        return "the FFI launcher library cannot open the CUDA driver (libcuda.so.1); install the NVIDIA driver"
    return None


def _nvcc() -> str | None:
    if shutil.which("nvcc") is None:
        return ("nvcc is not on PATH (the launcher's GPU tests compile stand-in kernels with it); install the "
                "CUDA toolkit or add its bin folder (e.g. /usr/local/cuda/bin) to PATH")  # fmt: skip
    return None


def _cubins() -> str | None:
    from jax_dsa_exchange.kernels import cache

    if cache.cutlass_available():
        return None  # (the kernels compile on first use)
    tail = cache.config_tag("x", 0, 0, 0, cache.source_hash()).rsplit("-", 1)[1]
    for d in cache.search_dirs():
        if d.is_dir() and any(p.name.endswith("-" + tail) for p in d.iterdir()):
            return None
    return (f"no prebuilt kernels of this source tree (source hash {tail}) in "
            f"{[str(d) for d in cache.search_dirs()]}, and the CuTe DSL is not installed to build them; "
            f"build them with `python dev/build_cubins.py` (on any machine with the kernels extra) and set "
            f"{cache.ENV_DIRS}=.cubins")  # fmt: skip


# piece -> check (None: present; else what is missing and how to install it), in the order the
# message lists them
PIECES = {
    "gpu": _gpu,
    "jax": _jax,
    "cupy": _cupy,
    "ffi": _ffi_lib,
    "driver": _driver,
    "nvcc": _nvcc,
    "cubins": _cubins,
}


@functools.cache
def missing(piece: str) -> str | None:
    """Why ``piece`` of the GPU stack is not usable here, or None."""
    return PIECES[piece]()


def requires(*pieces: str) -> pytest.MarkDecorator:
    """The mark of a test that needs these pieces of the GPU stack (see the module docstring)."""
    unknown = [p for p in pieces if p not in PIECES]
    if unknown or not pieces:
        raise ValueError(f"pieces {unknown or pieces}: expected some of {list(PIECES)}")
    return getattr(pytest.mark, MARK)(*pieces)


def first_missing(pieces) -> str | None:
    """The first missing piece of ``pieces`` in :data:`PIECES` order (later pieces are not
    checked: e.g. jax's backend is not started where there is no GPU)."""
    for p in PIECES:
        if p in pieces and missing(p):
            return p
    return None


# the raw-kernel tests: W ranks simulated in one process through CuPy, from prebuilt cubins
requires_gpu_stack = requires("gpu", "cupy", "cubins")
# the op in W processes through the FFI launcher
requires_op_stack = requires("gpu", "jax", "cupy", "ffi", "driver", "cubins")
# the launcher's GPU tests with stand-in kernels compiled by nvcc
requires_launcher_stack = requires("gpu", "jax", "driver", "nvcc")


def gpu_stack_missing() -> str | None:
    """Why the raw-kernel GPU tests cannot run here, or None."""
    p = first_missing(("gpu", "cupy", "cubins"))
    return p and missing(p)

