"""The FFI launcher library: builds, loads without a GPU, exports its symbols,
readable bookkeeping errors; on a GPU, kernel loading (cubin, PTX fallback)."""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

from gpu import requires, requires_launcher_stack
from jax_dsa_exchange import _ffi, layout
from jax_dsa_exchange.kernels import abi
from jax_dsa_exchange.kernels.abi import MERGE as MG
from jax_dsa_exchange.kernels.abi import SELECT_PUSH as SP

REPO = pathlib.Path(__file__).resolve().parents[1]
FAKE_CU = REPO / "ffi" / "testing" / "fake_kernels.cu"
SYMBOLS = [
    "DsaSelectPush", "DsaMerge", "DsaSelectPushNoGraph", "DsaMergeNoGraph", "dsa_last_error", "dsa_driver_available", "dsa_load_kernel",
    "dsa_register_exchange", "dsa_unregister_exchange", "dsa_num_exchanges", "dsa_launch_count", "dsa_ffi_api_version",
    "dsa_set_kernel_split", "dsa_producer_cluster", "dsa_producer_cache_tokens", "dsa_kernel_cluster_fit", "dsa_launcher_params",
    "dsa_set_kernel_cluster", "dsa_set_exchange_wide_merge", "dsa_merge_uses_wide",
    "dsa_set_exchange_lean_producer", "dsa_producer_uses_lean", "dsa_producer_lean_cluster", "dsa_layout_constant",
]

# clusters of c = 1..8 CTAs an H200 runs at once at select_push's full shared memory (the
# launcher's and the sim's cuOccupancyMaxActiveClusters; a probe of %smid found 128 CTAs in
# clusters of 4 or 8 on 120 SMs, two on some: docs/kernels.md)
H200_FIT = (132, 66, 39, 30, 22, 17, 15, 15)

needs_lib = requires("ffi")


def _cmake() -> str | None:
    exe = pathlib.Path(sys.executable).parent / "cmake"
    return str(exe) if exe.exists() else shutil.which("cmake")


def test_cmake_build(tmp_path):
    """The CMake project configures and builds; without cuda.h it builds nothing (and still succeeds)."""
    cmake = _cmake()
    if cmake is None:
        pytest.skip("cmake not installed")
    env = dict(os.environ, PATH=f"{pathlib.Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    cfg = subprocess.run(
        [cmake, "-S", str(REPO / "ffi"), "-B", str(tmp_path), f"-DPython_EXECUTABLE={sys.executable}"],
        capture_output=True, text=True, env=env,
    )
    assert cfg.returncode == 0, cfg.stdout + cfg.stderr
    build = subprocess.run([cmake, "--build", str(tmp_path)], capture_output=True, text=True, env=env)
    assert build.returncode == 0, build.stdout + build.stderr
    so = tmp_path / _ffi.LIB_NAME
    if "cuda.h not found" in cfg.stdout + cfg.stderr:
        assert not so.exists()
        pytest.skip("no cuda.h here: the launcher is (correctly) not built")
    assert so.exists()
    # A fresh process loads it without a GPU and sees every symbol.
    code = (
        "import ctypes, sys; lib = ctypes.CDLL(sys.argv[1]); "
        f"[getattr(lib, s) for s in {SYMBOLS!r}]; print('ok')"
    )
    run = subprocess.run([sys.executable, "-c", code, str(so)], capture_output=True, text=True)
    assert run.returncode == 0 and "ok" in run.stdout, run.stderr


def test_candidate_paths_cover_install_and_checkout(monkeypatch):
    monkeypatch.setenv("JAX_DSA_EXCHANGE_FFI_LIB", "/nowhere/libx.so")
    paths = _ffi.candidate_paths()
    assert paths[0] == "/nowhere/libx.so"
    pkg = str(REPO / "jax_dsa_exchange" / "_lib" / _ffi.LIB_NAME)
    assert pkg in paths
    assert any(p.endswith(os.path.join("jax_dsa_exchange", "_lib", _ffi.LIB_NAME)) and p != pkg for p in paths)


@needs_lib
def test_exports_symbols():
    lib = _ffi.library()
    for s in SYMBOLS:
        assert getattr(lib, s) is not None
    assert _ffi.register_targets()


@needs_lib
def test_built_for_this_jax():
    built = divmod(_ffi.library().dsa_ffi_api_version(), 1000)
    running = _ffi.runtime_ffi_api_version()
    assert running is not None and built[0] == running[0] and built[1] <= running[1]


def test_too_new_library_is_refused_with_a_clear_message(monkeypatch):
    class FakeLib:
        def dsa_ffi_api_version(self):
            return 99
    monkeypatch.setattr(_ffi, "runtime_ffi_api_version", lambda: (0, 4))
    why = _ffi._compatible(FakeLib(), "/x/libdsa_exchange_ffi.so")
    assert "built against XLA FFI API 0.99" in why and "speaks 0.4" in why and "--no-build-isolation" in why


@needs_lib
def test_unknown_exchange_error_is_readable():
    with pytest.raises(RuntimeError, match=r"no exchange registered \(exchange 987654, device 3\)"):
        _ffi.unregister_exchange(987654, 3)


def _reg_kwargs(**kw):
    base = dict(rank=0, world=2, topk=64, local_topk=32, max_rows=8, peers=1 << 20, local=1 << 20,
                state=1 << 21, rescue_off=0, flags_off=0, timeout_us=1000, merge_grid=4,
                select_key="nope_select", merge_key="nope_merge")
    base.update(kw)
    return base


@needs_lib
def test_register_errors_are_readable():
    with pytest.raises(RuntimeError, match=r"kernel 'nope_select' not loaded on device 0"):
        _ffi.register_exchange(11, 0, **_reg_kwargs())
    with pytest.raises(RuntimeError, match=r"rank 5 not in \[0, world=2\)"):
        _ffi.register_exchange(11, 0, **_reg_kwargs(rank=5))
    with pytest.raises(RuntimeError, match="must be device addresses"):
        _ffi.register_exchange(11, 0, **_reg_kwargs(state=0))
    assert _ffi.num_exchanges() == 0


@needs_lib
def test_set_kernel_cluster_errors_are_readable():
    with pytest.raises(RuntimeError, match=r"kernel 'nope_merge' on device 0 is not loaded"):
        _ffi.set_kernel_cluster("nope_merge", 0, 4)


@needs_lib
def test_set_exchange_wide_merge_errors_are_readable():
    with pytest.raises(RuntimeError, match=r"no exchange registered \(exchange 987654"):
        _ffi.set_exchange_wide_merge(987654, 0, "nope_merge", 4)


@needs_lib
def test_set_exchange_lean_producer_errors_are_readable():
    with pytest.raises(RuntimeError, match=r"no exchange registered \(exchange 987654"):
        _ffi.set_exchange_lean_producer(987654, 0, "nope_select")


@needs_lib
def test_producer_image_choice_is_layouts():
    """The launcher runs the lean producer exactly where layout.producer_uses_lean says: a lean
    image (its slice_max > 0) and every slice, cut from min(cols, 2**17), within it."""
    for lean_max in (0, 8192, layout.PRODUCER_LEAN_SLICE_MAX):
        for cols in (0, 1, 8, 4095, 8192, 8193, 16384, 16385, 32768, 65537, 131072, 131080, 1 << 20):
            for c in range(1, layout.PRODUCER_CLUSTER_MAX + 1):
                want = layout.producer_uses_lean(cols, c, lean_max)
                assert _ffi.producer_uses_lean(cols, c, lean_max) == want, (cols, c, lean_max)


@needs_lib
def test_lean_cluster_is_layouts():
    """The launcher cuts a lean launch's rows exactly as layout.producer_lean_cluster does: the
    lean image's own split, one with other values, and the split of ranks sharing a GPU
    (Exchange: cluster_max 1, fill_ctas 0: select_push's C, unchanged)."""
    base = layout.producer_lean_split()
    for split in (base, dict(base, min_slice=4096, fill_ctas=132, cluster_max=4), dict(base, cluster_max=1, fill_ctas=0),
                  dict(base, min_slice=0, fill_ctas=-1)):
        for rows in (1, 2, 3, 16, 17, 33, 64, 65, 256):
            for cols in (0, 1, 8, 2048, 2049, 8192, 20001, 32768, 131072, 1 << 20):
                for c in range(1, layout.PRODUCER_CLUSTER_MAX + 1):
                    want = layout.producer_lean_cluster(rows, cols, c, split)
                    assert _ffi.producer_lean_cluster(rows, cols, c, split) == want, (rows, cols, c, split)


@needs_lib
def test_merge_image_choice_is_layouts():
    """The launcher runs merge_wide exactly where layout.merge_uses_wide says: a wide image
    (wide_grid > 0) and every row its own cluster of it."""
    for wide_grid in (0, 1, 7, 30, 66):
        for rows in (0, 1, 2, 7, 8, 29, 30, 31, 64, 65, 66, 67, 256):
            want = layout.merge_uses_wide(rows, wide_grid)
            assert _ffi.merge_uses_wide(rows, wide_grid) == want, (rows, wide_grid)
            assert want == (wide_grid > 0 and 1 <= rows <= wide_grid)


@needs_lib
def test_load_kernel_without_driver_is_readable():
    if _ffi.driver_available():
        pytest.skip("a CUDA driver is present")
    with pytest.raises(RuntimeError, match="kernel 'k' on device 0: cannot dlopen libcuda.so.1"):
        _ffi.load_kernel("k", SP.kernel, SP.pairs(), b"\0" * 16, None, "entry", 0, 128, 0)


@needs_lib
def test_launcher_params_are_the_abi():
    """The launcher fills exactly the parameters kernels/abi.py declares (names, types)."""
    for name, k in abi.KERNELS.items():
        assert _ffi.launcher_params(name) == k.pairs()
    assert _ffi.launcher_params("other") == ()


@needs_lib
@pytest.mark.parametrize("kernel,params,where", [
    ("select_push", SP.pairs()[:-1], "do not match"),  # one missing
    ("select_push", SP.pairs() + (("extra", "i32"),), "at 'extra:i32'"),
    ("merge", tuple(("rows", "i64") if n == "rows" else (n, t) for n, t in MG.pairs()), "at 'rows:i64'"),
    ("merge", SP.pairs(), "do not match the launcher's merge params"),
    ("merge", MG.pairs()[:3] + MG.pairs()[2:], "at 'state:i64'"),  # a name twice
    ("other", MG.pairs(), "unknown kernel 'other'"),
])  # fmt: skip
def test_launcher_refuses_other_params(kernel, params, where):
    """A kernel image whose metadata names other parameters than the launcher's is refused
    at load (before any driver call), naming both lists."""
    with pytest.raises(RuntimeError, match=re.escape(where)):
        _ffi.load_kernel("k_bad", kernel, params, b"\0" * 16, None, "entry", 0, 128, 0)


@needs_lib
def test_launcher_params_any_order_is_accepted():
    """The launcher packs by name: the metadata's order is the launch order (checked on
    the GPU by the fake kernels); here only that a permutation passes the name check."""
    if _ffi.driver_available():
        pytest.skip("a CUDA driver is present")
    with pytest.raises(RuntimeError, match="cannot dlopen libcuda.so.1"):
        _ffi.load_kernel("k_perm", "merge", MG.pairs()[::-1], b"\0" * 16, None, "entry", 0, 128, 0)


@needs_lib
def test_launcher_layout_constants_are_layout_py():
    """The C++ status codes, status word indices and state offsets equal layout.py's."""
    assert _ffi.layout_constants() == layout.launcher_constants()


def test_fake_kernels_have_the_abi():
    """ffi/testing/fake_kernels.cu (the launcher's GPU test kernels) take the parameters
    of kernels/abi.py, in order."""
    text = FAKE_CU.read_text()
    for entry, k in (("fake_select_push", SP), ("fake_merge", MG)):
        m = re.search(r"__global__ void " + entry + r"\((.*?)\)", text, re.S)
        assert m, entry
        got = [tuple(a.split()) for a in m.group(1).split(",")]
        assert [(n, {"int64_t": "i64", "int": "i32"}[t]) for t, n in got] == list(k.pairs()), entry


@needs_lib
def test_launcher_splits_rows_like_layout():
    """The C++ launcher's cluster size (from the metadata's split) equals
    layout.producer_cluster for every shape, default and other splits."""
    base = layout.producer_split()
    splits = [base, dict(slice_max=4096, cluster_max=8, min_slice=512, fill_ctas=132),
              dict(slice_max=16384, cluster_max=1, min_slice=2048, fill_ctas=264),
              dict(base, cluster_fit=H200_FIT), dict(base, cluster_fit=(132, 66, 44, 33, 0, 2, -1, 9)),
              dict(base, cluster_fit=(200, 100, 60, 50, 40, 30, 20, 20)),
              dict(base, cluster_max=1, fill_ctas=0, cluster_fit=H200_FIT)]  # fmt: skip
    cols = [1, 7, 8, 100, 2047, 2048, 2049, 4096, 8191, 8192, 16383, 16384, 16385, 32768, 40000,
            65536, 100000, 131071, 131072, 1 << 18]  # fmt: skip
    for split in splits:
        for rows in (1, 2, 3, 16, 33, 64, 100, 132, 256, 1000):
            for c in cols:
                want = layout.producer_cluster(rows, c, split)
                assert _ffi.producer_cluster(rows, c, split) == want, (rows, c, split)
                assert 1 <= want <= split["cluster_max"]
                if want > 1 and rows > layout.producer_cluster_fit(split)[want - 1]:
                    # more rows than run at once only because one CTA fewer leaves its slice
                    # uncached
                    sp = dict(split, cache_max=split.get("cache_max", 0), cache_wide=split.get("cache_wide", 0))
                    longer = -(-(-(-min(c, layout.MAX_LOCAL_LEN) // (want - 1))) // 8) * 8
                    assert layout.producer_cache_tokens(rows, c, want - 1, sp) < longer, (rows, c, split)
    # what the policy gives at the benchmark's shapes (an H200 sweep of forced splits, docs/kernels.md)
    # without the device's cluster counts
    for (rows, cols), want in {(1, 8192): 1, (1, 32768): 4, (1, 131072): 8, (8, 131072): 8, (16, 32768): 4, (16, 131072): 4,
                               (64, 32768): 2, (64, 131072): 2, (128, 131072): 4, (256, 32768): 1,
                               (256, 131072): 4}.items():  # fmt: skip
        assert layout.producer_cluster(rows, cols) == want, (rows, cols)
    # and with an H200's (a sweep of every C, docs/kernels.md): the widest cluster whose rows all
    # run at once at one CTA per SM
    h200 = dict(base, cluster_fit=H200_FIT)
    for (rows, cols), want in {(1, 131072): 8, (12, 131072): 8, (15, 131072): 8, (16, 131072): 6,
                               (16, 65536): 6, (16, 32768): 4, (24, 131072): 4, (32, 131072): 3,
                               (32, 32768): 3, (64, 131072): 2, (128, 131072): 4, (256, 131072): 4,
                               (256, 32768): 1}.items():  # fmt: skip
        assert layout.producer_cluster(rows, cols, h200) == want, (rows, cols)
        assert _ffi.producer_cluster(rows, cols, h200) == want, (rows, cols)
    # the rule before the counts is the same rule with unknown counts
    assert layout.producer_cluster_fit(base) == (132, 66, 44, 33, 13, 11, 9, 8)
    assert layout.producer_cluster_fit(dict(base, cluster_fit=(-1,) * 8)) == layout.producer_cluster_fit(base)
    assert layout.producer_cluster_fit(h200) == H200_FIT


@needs_lib
def test_launcher_caches_slices_like_layout():
    """The C++ launcher's cache_tokens (which sizes the launch's shared memory) equals
    layout.producer_cache_tokens for every shape and cluster size; it always covers the
    launch's longest slice or is slice_max, and never exceeds cache_max."""
    base = layout.producer_split()
    splits = [base, dict(base, cache_max=32768, cache_wide=16384), dict(base, cache_max=16384, cache_wide=16384),
              dict(base, cluster_fit=H200_FIT), dict(base, cache_max=32768, cache_wide=16384, cluster_fit=H200_FIT),
              dict(base, cluster_fit=(10, 5, 3, 2, 1, 1, 0, 0)),
              dict(base, slice_max=4096, cache_max=32768, cache_wide=8192),
              dict(base, slice_max=4096, cache_max=32768, cache_wide=8192, cluster_fit=H200_FIT),
              dict(base, fill_ctas=0, cluster_max=1)]
    cols = [1, 7, 8, 100, 4096, 16383, 16384, 16385, 32768, 32769, 40000, 65536, 65537, 100000, 131072]
    for split in splits:
        for rows in (1, 2, 6, 16, 20, 31, 64, 66, 132, 133, 256):
            for c in cols:
                for cl in range(1, 11):
                    want = layout.producer_cache_tokens(rows, c, cl, split)
                    assert _ffi.producer_cache_tokens(rows, c, cl, split) == want, (rows, c, cl, split)
                    longest = -(-(-(-min(c, layout.MAX_LOCAL_LEN) // cl)) // 8) * 8
                    assert want == longest or want == split["slice_max"], (rows, c, cl, want)
                    assert want <= split["cache_max"] and want % 8 == 0
    # what the policy gives at the benchmark's shapes
    assert layout.producer_cache_tokens(64, 131072, layout.producer_cluster(64, 131072)) == 65536
    assert layout.producer_cache_tokens(256, 131072, layout.producer_cluster(256, 131072)) == 32768
    assert layout.producer_cache_tokens(256, 32768, layout.producer_cluster(256, 32768)) == 32768


def _old_cluster(rows, cols, sp):
    """The rule before the device's cluster counts were known, for the test below."""
    length = max(1, min(cols, layout.MAX_LOCAL_LEN))
    c = min(sp["cluster_max"], -(-length // max(1, sp["min_slice"])))
    while c > 1 and rows * c > sp["fill_ctas"]:
        c -= 1
    while c > layout.PRODUCER_WIDE_CLUSTER and rows * c > sp["fill_ctas"] // 2:
        c -= 1
    c = max(1, c)
    while c < sp["cluster_max"] and _old_cache(rows, cols, c, sp) < -(-(-(-length // c)) // 8) * 8:
        c += 1
    return c


def _old_cache(rows, cols, c, sp):
    length = max(1, min(cols, layout.MAX_LOCAL_LEN))
    c = max(1, c)
    s = -(-(-(-length // c)) // 8) * 8
    if s <= sp["slice_max"]:
        return s
    if s <= sp["cache_max"] and (s <= sp["cache_wide"] or rows * c <= sp["fill_ctas"]):
        return s
    return sp["slice_max"]


@needs_lib
def test_policy_without_cluster_counts_is_the_old_rule():
    """No count of co-resident clusters (CI, a driver without cuOccupancyMaxActiveClusters,
    or every entry -1): the cluster size and the slice cache are the rule without counts,
    for every shape and the splits that differ from the default in each parameter."""
    base = layout.producer_split()
    splits = [base, dict(base, cache_max=32768, cache_wide=16384), dict(base, cache_max=24576, cache_wide=16384),
              dict(base, slice_max=4096, min_slice=512), dict(base, fill_ctas=0, cluster_max=1),
              dict(base, fill_ctas=264), dict(base, cluster_max=4)]
    cols = [1, 100, 8191, 8192, 16385, 32768, 40000, 65536, 100000, 131072]
    for split in splits:
        for fit in (None, (-1,) * layout.PRODUCER_CLUSTER_MAX):
            sp = dict(split) if fit is None else dict(split, cluster_fit=fit)
            for rows in range(1, 270, 3):
                for c in cols:
                    want = _old_cluster(rows, c, split)
                    assert layout.producer_cluster(rows, c, sp) == want, (rows, c, split)
                    assert _ffi.producer_cluster(rows, c, sp) == want, (rows, c, split)
                    for cl in range(1, 11):
                        want = _old_cache(rows, c, cl, split)
                        assert layout.producer_cache_tokens(rows, c, cl, sp) == want, (rows, c, cl, split)
                        assert _ffi.producer_cache_tokens(rows, c, cl, sp) == want, (rows, c, cl, split)


# ----------------------------------------------------------------------------- GPU


gpu = requires_launcher_stack


def compile_fake(tmp: pathlib.Path) -> tuple[bytes, str]:
    cubin, ptx = tmp / "fake.cubin", tmp / "fake.ptx"
    subprocess.run(["nvcc", "-cubin", "-arch=sm_90a", "-o", str(cubin), str(FAKE_CU)], check=True)
    subprocess.run(["nvcc", "-ptx", "-arch=sm_90a", "-o", str(ptx), str(FAKE_CU)], check=True)
    return cubin.read_bytes(), ptx.read_text()


@pytest.mark.gpu
@gpu
def test_load_kernel_cubin_ptx_fallback_and_register(tmp_path):
    cubin, ptx = compile_fake(tmp_path)
    sp, mg = (SP.kernel, SP.pairs()), (MG.kernel, MG.pairs())
    assert _ffi.load_kernel("t_sel", *sp, cubin, ptx, "fake_select_push", 0, 128, 0) == "cubin"
    assert _ffi.load_kernel("t_sel", *sp, cubin, ptx, "fake_select_push", 0, 128, 0) == "cubin"  # once
    with pytest.raises(RuntimeError, match="already loaded with other launch parameters"):
        _ffi.load_kernel("t_sel", *sp, cubin, ptx, "fake_select_push", 0, 256, 0)
    # A cubin the driver refuses falls back to the PTX; > 48 KB dynamic smem opts in.
    assert _ffi.load_kernel("t_merge_ptx", *mg, b"garbage-not-a-cubin", ptx, "fake_merge", 0, 128, 100 << 10) == "ptx"
    with pytest.raises(RuntimeError, match=r"cuModuleLoadDataEx\(cubin\) failed: CUDA_ERROR_"):
        _ffi.load_kernel("t_bad", MG.kernel, MG.pairs(), b"garbage", None, "fake_merge", 0, 128, 0)
    with pytest.raises(RuntimeError, match=r"cuModuleGetFunction\('no_such_entry'\) failed: CUDA_ERROR_NOT_FOUND"):
        _ffi.load_kernel("t_noentry", MG.kernel, MG.pairs(), cubin, None, "no_such_entry", 0, 128, 0)
    # An image of another target is refused before any load, naming both targets and the build
    # command; the device's own target loads (the stand-in is built for sm_90a: a Hopper device)
    with pytest.raises(RuntimeError, match=r"built for sm_100a, but the device is (sm_\d+a): build the kernels "
                                           r"for it with python -m jax_dsa_exchange.build --arch \1") as e:
        _ffi.load_kernel("t_arch", *sp, cubin, ptx, "fake_select_push", 0, 128, 0, arch="sm_100a")
    mine = re.search(r"the device is (sm_\d+a)", str(e.value)).group(1)
    assert mine == "sm_90a"
    assert _ffi.load_kernel("t_arch_ok", *sp, cubin, ptx, "fake_select_push", 0, 128, 0, arch=mine) == "cubin"
    _ffi.register_exchange(
        4242, 0, **_reg_kwargs(select_key="t_sel", merge_key="t_merge_ptx")
    )
    with pytest.raises(RuntimeError, match="already registered"):
        _ffi.register_exchange(4242, 0, **_reg_kwargs(select_key="t_sel", merge_key="t_merge_ptx"))
    _ffi.unregister_exchange(4242, 0)
    assert _ffi.num_exchanges() == 0



@pytest.mark.parametrize("value,mode", [(None, "on"), ("1", "on"), ("on", "on"), ("0", "off"),
                                        ("off", "off"), ("checked", "checked"), ("CHECKED", "checked")])
def test_cuda_graph_mode_from_the_environment(monkeypatch, value, mode):
    from jax_dsa_exchange import _ffi

    if value is None:
        monkeypatch.delenv("JAX_DSA_EXCHANGE_CUDA_GRAPHS", raising=False)
    else:
        monkeypatch.setenv("JAX_DSA_EXCHANGE_CUDA_GRAPHS", value)
    assert _ffi.cuda_graph_mode() == mode
    assert _ffi.cuda_graphs_enabled() == (mode != "off")


def test_cuda_graph_mode_rejects_unknown_values(monkeypatch):
    from jax_dsa_exchange import _ffi

    monkeypatch.setenv("JAX_DSA_EXCHANGE_CUDA_GRAPHS", "sometimes")
    with pytest.raises(ValueError, match="sometimes"):
        _ffi.cuda_graph_mode()
