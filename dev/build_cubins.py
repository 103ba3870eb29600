"""Build what the GPU checks need, on any machine with the kernels extra (no GPU needed):

* the cubins of every configuration the GPU tests, the op tests and the benchmarks use, into
  .cubins (``--out``), gzipped (dev/pack_cubins.sh: about 3x smaller to copy to the GPU node);
* the FFI launcher library into build/ffi_lib, compiled against the XLA FFI headers of the
  oldest supported jax (the ``jaxlib==`` pin of pyproject.toml's build requirements): XLA
  refuses a handler built against a newer FFI API than its own, and accepts older ones.

    python dev/build_cubins.py [--quick] [--jobs 2] [--out .cubins] [--no-ffi] [--ffi-include DIR]

Then, on the GPU node, from the repository root with .cubins and build/ffi_lib copied there:
``python dev/gpu_check.py``.  The FFI headers: ``--ffi-include DIR`` (a jaxlib/include folder
of that jax), else the installed jaxlib's where its version is the pinned one, else those of the
pinned jaxlib wheel fetched with ``pip download`` (needs the package index).  Needs cmake and
cuda.h (the CUDA toolkit or the nvidia-cuda-runtime pip wheel's include folder; CUDA_HOME).
Standard library only; the builds themselves run ``python -m jax_dsa_exchange.build``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
LIB = "libdsa_exchange_ffi.so"

# (worlds, topks, local_topks, kinds[, interleaves]): the arguments of one `python -m
# jax_dsa_exchange.build`; kinds "both" = the default kernels and the rescue-list ones
# (Exchange.create(rescue_list=True)); interleaves: the KV cache's interleave sizes (default 1)
CONFIGS = [
    # tests/test_kernels_gpu.py and test_select_gpu.py (CONFIGS there), the benchmark grid
    ((1, 2, 4, 8, 16), (256,), (64, 256), "both"),
    ((8,), (2048,), (256, 512, 1024), "both"),
    ((16,), (2048,), (512, 1024), "both"),
    ((2,), (2048,), (512,), "both"),
    ((16,), (4096,), (2048,), "both"),
    # N = K: the rescue's local top-K timed by the benchmark's merge table
    ((8, 16), (2048,), (2048,), "default"),
    # the op tests (tests/test_op_gpu.py and its workers), the demo, the examples
    ((1,), (2048,), (2048,), "default"),
    ((3,), (256,), (64,), "default"),
    ((4,), (512,), (128,), "both"),
    ((4, 5, 10), (2048,), (1024,), "default"),
    ((7,), (2048,), (2048,), "default"),
    ((16,), (2048,), (256,), "default"),
    ((3,), (1024,), (128,), "default"),
    # KV caches interleaved in chunks (tests/test_kernels_gpu.py INTERLEAVED)
    ((1, 2, 8, 16), (256,), (64,), "both", (2, 16, 64)),
    ((3,), (256,), (64,), "both", (16,)),
    ((8,), (2048,), (512,), "both", (16,)),
    ((16,), (2048,), (1024,), "both", (64,)),
    ((16,), (4096,), (2048,), "both", (3,)),
    ((4,), (512,), (128,), "default", (3,)),  # (test_op_gpu.py; its W = 2 one is above)
]
# a few representative configurations (a quick check of a kernel change)
QUICK = [
    ((8,), (2048,), (512,), "both"),
    ((16,), (2048,), (1024,), "both"),
    ((16,), (4096,), (2048,), "default"),
    ((1,), (256,), (64,), "default"),
    ((10,), (2048,), (1024,), "default"),
]


def build_argv(python: str, cfg: tuple, out: str, arch: str = "sm_90a") -> list:
    worlds, topks, ns, kinds, *rest = cfg
    argv = [python, "-m", "jax_dsa_exchange.build", "--arch", arch, "--world", *map(str, worlds),
            "--topk", *map(str, topks), "--local-topk", *map(str, ns), "--out", out]  # fmt: skip
    if rest:
        argv += ["--interleave", *map(str, rest[0])]
    return argv + (["--both"] if kinds == "both" else [])


def pinned_jaxlib(pyproject: pathlib.Path = ROOT / "pyproject.toml") -> str:
    """The jaxlib version pyproject.toml's [build-system] requires (the oldest supported)."""
    text = pyproject.read_text()
    section = text.split("[build-system]", 1)[1].split("\n[", 1)[0]
    m = re.search(r'"jaxlib==([0-9][0-9.]*)"', section)
    if not m:
        raise SystemExit(f"{pyproject}: no \"jaxlib==X\" in [build-system] requires")
    return m.group(1)


def installed_jaxlib(python: str) -> tuple:
    """(version, include folder) of the jaxlib ``python`` imports, or (None, None)."""
    r = subprocess.run([python, "-c", "import jax, jax.ffi, jaxlib; print(jaxlib.__version__); "
                        "print(jax.ffi.include_dir())"], capture_output=True, text=True)  # fmt: skip
    if r.returncode != 0:
        return None, None
    version, include = r.stdout.split("\n")[:2]
    return version.strip(), include.strip()


def wheel_include(wheel: pathlib.Path, dest: pathlib.Path) -> pathlib.Path:
    """Unpack jaxlib/include of a jaxlib wheel into dest; return that include folder."""
    with zipfile.ZipFile(wheel) as z:
        members = [m for m in z.namelist() if m.startswith("jaxlib/include/")]
        if not any(m.endswith("xla/ffi/api/ffi.h") for m in members):
            raise SystemExit(f"{wheel}: no jaxlib/include/xla/ffi/api/ffi.h in it")
        z.extractall(dest, members)
    return dest / "jaxlib" / "include"


def ffi_include(a, version: str, tmp: pathlib.Path) -> tuple:
    """(the XLA FFI include folder to build against, where it comes from)."""
    if a.ffi_include:
        return pathlib.Path(a.ffi_include), f"--ffi-include {a.ffi_include}"
    have, include = installed_jaxlib(a.python)
    if have == version:
        return pathlib.Path(include), f"the installed jaxlib {have}"
    print(f"ffi: the installed jaxlib is {have}, the library is built against {version}'s headers: "
          f"pip download jaxlib=={version}", flush=True)  # fmt: skip
    r = subprocess.run([a.python, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", f"jaxlib=={version}",
                        "-d", str(tmp)], capture_output=True, text=True)  # fmt: skip
    wheels = sorted(tmp.glob(f"jaxlib-{version}-*.whl"))
    if r.returncode != 0 or not wheels:
        raise SystemExit(f"could not fetch jaxlib=={version} ({r.stderr.strip()[-500:]}); pass --ffi-include "
                         f"with the jaxlib/include folder of a jaxlib {version} install")  # fmt: skip
    return wheel_include(wheels[0], tmp / "unpacked"), f"the jaxlib {version} wheel"


def ffi_api_version(lib: pathlib.Path) -> int:
    return int(ctypes.CDLL(str(lib)).dsa_ffi_api_version())


def build_ffi(a) -> int:
    version = pinned_jaxlib()
    cmake = shutil.which("cmake") or str(pathlib.Path(a.python).parent / "cmake")
    if not os.path.exists(cmake):
        print("ffi: cmake not found (pip install cmake)", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        include, source = ffi_include(a, version, pathlib.Path(tmp))
        build = ROOT / "build" / f"ffi-jaxlib{version}"
        cfg = subprocess.run([cmake, "-S", str(ROOT / "ffi"), "-B", str(build), f"-DJAX_FFI_INCLUDE_DIR={include}",
                              f"-DPython_EXECUTABLE={a.python}"], capture_output=True, text=True)  # fmt: skip
        if cfg.returncode != 0:
            print(cfg.stdout + cfg.stderr, file=sys.stderr)
            return 1
        if "cuda.h not found" in cfg.stdout + cfg.stderr:
            print("ffi: cuda.h not found: set CUDA_HOME to a CUDA toolkit (or pip install nvidia-cuda-runtime-cu12)",
                  file=sys.stderr)  # fmt: skip
            return 1
        b = subprocess.run([cmake, "--build", str(build)], capture_output=True, text=True)
        if b.returncode != 0:
            print(b.stdout + b.stderr, file=sys.stderr)
            return 1
    dest = ROOT / "build" / "ffi_lib"
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy2(build / LIB, dest / LIB)
    major, minor = divmod(ffi_api_version(dest / LIB), 1000)
    print(f"ffi: {dest / LIB}, built against XLA FFI API {major}.{minor} (the headers of {source}; the oldest "
          f"supported jax is {version})", flush=True)  # fmt: skip
    return 0


def build_cubins(a) -> int:
    out = str(pathlib.Path(a.out).resolve())
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env["JAX_DSA_EXCHANGE_CACHE"] = tempfile.mkdtemp(prefix="cubin_cache")  # (never read a user cache)
    configs = QUICK if a.quick else CONFIGS

    def one(cfg):
        argv = build_argv(a.python, cfg, out, a.arch)
        r = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True)
        return argv, r

    failed = 0
    with concurrent.futures.ThreadPoolExecutor(max_workers=a.jobs) as ex:
        for argv, r in ex.map(one, configs):
            print(f"{'ok' if r.returncode == 0 else 'FAILED'}: {' '.join(argv[1:])}", flush=True)
            if r.returncode != 0:
                failed += 1
                print(r.stdout[-2000:] + r.stderr[-4000:], file=sys.stderr)
    shutil.rmtree(env["JAX_DSA_EXCHANGE_CACHE"], ignore_errors=True)
    if failed:
        return 1
    if not a.no_pack:
        subprocess.run(["bash", str(ROOT / "dev" / "pack_cubins.sh"), out], check=True)
    n = sum(1 for d in pathlib.Path(out).iterdir() if d.is_dir())
    print(f"cubins: {n} configuration folders in {out}", flush=True)
    return 0


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python dev/build_cubins.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--out", default=str(ROOT / ".cubins"), help="folder of the cubins (default: .cubins)")
    ap.add_argument("--quick", action="store_true", help=f"{len(QUICK)} representative configurations only")
    ap.add_argument("--jobs", type=int, default=1, help="builds at once (each one CPU core; default 1)")
    ap.add_argument("--arch", default="sm_90a", choices=("sm_90a", "sm_100a", "sm_103a"),
                    help="the GPU target (jax_dsa_exchange.layout.ARCHS; default sm_90a: H100, H200)")
    ap.add_argument("--python", default=sys.executable,
                    help="the interpreter with the kernels extra (default: this one)")
    ap.add_argument("--no-pack", action="store_true", help="leave the cubins and PTX unzipped")
    ap.add_argument("--no-ffi", action="store_true", help="build the cubins only")
    ap.add_argument("--no-cubins", action="store_true", help="build the FFI library only")
    ap.add_argument("--ffi-include", metavar="DIR", help="the jaxlib/include folder of the pinned jaxlib")
    a = ap.parse_args(argv)
    if a.jobs < 1:
        ap.error(f"--jobs {a.jobs}: expected at least 1")
    if a.no_ffi and a.no_cubins:
        ap.error("--no-ffi and --no-cubins: nothing to build")
    if a.ffi_include and not (pathlib.Path(a.ffi_include) / "xla" / "ffi" / "api" / "ffi.h").is_file():
        ap.error(f"--ffi-include {a.ffi_include}: no xla/ffi/api/ffi.h in it")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    rc = 0
    if not a.no_cubins:
        rc |= build_cubins(a)
    if not a.no_ffi:
        rc |= build_ffi(a)
    return rc


if __name__ == "__main__":
    sys.exit(main())
