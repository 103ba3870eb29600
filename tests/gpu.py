"""Skip markers for tests that need the GPU stack (a CUDA GPU, CuPy, the FFI library)."""

import functools
import shutil
import subprocess

import pytest


@functools.cache
def gpu_count() -> int:
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except Exception:
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


@functools.cache
def gpu_stack_missing() -> str | None:
    """Why the GPU tests cannot run here, or None."""
    if gpu_count() == 0:
        return "no NVIDIA GPU"
    try:
        import cupy  # noqa: F401
    except ImportError:
        return "CuPy is not installed"
    return None


requires_gpu_stack = pytest.mark.skipif(gpu_stack_missing() is not None,
                                        reason=str(gpu_stack_missing()))
