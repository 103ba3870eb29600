"""ctypes side of the XLA FFI launcher (ffi/dsa_exchange_ffi.cc).

The shared library ``libdsa_exchange_ffi.so`` is looked for, first hit wins:

1. ``$JAX_DSA_EXCHANGE_FFI_LIB`` (a file path);
2. ``jax_dsa_exchange/_lib/`` next to this module (a normal ``pip install .``);
3. ``jax_dsa_exchange/_lib/`` under every ``sys.path`` / site-packages entry
   (the package is imported from the checkout while ``pip install`` put the
   library into site-packages);
4. the checkout's build folders, newest first: ``build/*/`` (scikit-build-core's
   ``build-dir``) and ``build/ffi/`` (``cmake -S ffi -B build/ffi``).

Loading needs no GPU: libcuda is opened by the library at first use.  When the
library is found, importing this module registers the two FFI targets
``dsa_select_push`` and ``dsa_merge`` for the CUDA platform.

All functions here run outside the hot path and outside CUDA graph capture.
Errors raise ``RuntimeError`` with the library's message.
"""

from __future__ import annotations

import ctypes
import glob
import os
import re
import site
import sys
import threading

# jax (with ml_dtypes) is imported before the launcher library is loaded: on the
# GPU image (jax 0.11.2) loading the library first made the later `import jax`
# crash inside ml_dtypes (segfault in ml_dtypes._finfo); this order was fine.
import jax

LIB_NAME = "libdsa_exchange_ffi.so"
TARGETS = {"dsa_select_push": "DsaSelectPush", "dsa_merge": "DsaMerge"}
# Same handlers without the command-buffer (CUDA graph) trait.
TARGETS_NO_GRAPH = {"dsa_select_push": "DsaSelectPushNoGraph", "dsa_merge": "DsaMergeNoGraph"}

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_load_error: str | None = None
_found_unusable = False  # a library file exists but could not be used (see load_error())
_registered = False


def candidate_paths() -> list[str]:
    """Where the library is looked for, in order (see the module docstring)."""
    here = os.path.dirname(os.path.abspath(__file__))
    paths = []
    env = os.environ.get("JAX_DSA_EXCHANGE_FFI_LIB")
    if env:
        paths.append(env)
    paths.append(os.path.join(here, "_lib", LIB_NAME))
    roots = list(sys.path)
    try:
        roots += site.getsitepackages() + [site.getusersitepackages()]
    except AttributeError:  # pragma: no cover - virtualenv's old site module
        pass
    for root in roots:
        if root:
            paths.append(os.path.join(os.path.abspath(root), "jax_dsa_exchange", "_lib", LIB_NAME))
    repo = os.path.dirname(here)
    built = glob.glob(os.path.join(repo, "build", "*", LIB_NAME))
    built.sort(key=os.path.getmtime, reverse=True)
    paths += built
    seen, out = set(), []
    for p in paths:
        if p not in seen:
            seen.add(p)
            out.append(p)
    return out


def _declare(lib: ctypes.CDLL) -> None:
    i64, i32, cp = ctypes.c_int64, ctypes.c_int, ctypes.c_char_p
    lib.dsa_last_error.restype = cp
    lib.dsa_last_error.argtypes = []
    lib.dsa_driver_available.restype = i32
    lib.dsa_driver_available.argtypes = []
    lib.dsa_load_kernel.restype = i32
    lib.dsa_load_kernel.argtypes = [cp, cp, cp, ctypes.c_void_p, i64, cp, cp, i32, i32, i32, cp]
    lib.dsa_launcher_params.restype = cp
    lib.dsa_launcher_params.argtypes = [cp]
    lib.dsa_layout_constant.restype = i64
    lib.dsa_layout_constant.argtypes = [cp]
    lib.dsa_set_kernel_split.restype = i32
    lib.dsa_set_kernel_split.argtypes = [cp, i32, i32, i32, i32, i32, i32, i32]
    lib.dsa_producer_cluster.restype = i32
    ip = ctypes.POINTER(ctypes.c_int)
    lib.dsa_producer_cluster.argtypes = [i32, i32, i32, i32, i32, i32, i32, i32, ip]
    lib.dsa_producer_cache_tokens.restype = i32
    lib.dsa_producer_cache_tokens.argtypes = [i32, i32, i32, i32, i32, i32, i32, i32, i32, ip]
    lib.dsa_kernel_cluster_fit.restype = i32
    lib.dsa_kernel_cluster_fit.argtypes = [cp, i32, ip]
    lib.dsa_set_kernel_cluster.restype = i32
    lib.dsa_set_kernel_cluster.argtypes = [cp, i32, i32, ip]
    lib.dsa_register_exchange.restype = i32
    lib.dsa_register_exchange.argtypes = [i64, i32, i32, i32, i32, i32, i32, i64, i64, i64, i64, i64, i32, i32, cp, cp,
                                          i64]
    lib.dsa_unregister_exchange.restype = i32
    lib.dsa_unregister_exchange.argtypes = [i64, i32]
    lib.dsa_set_exchange_wide_merge.restype = i32
    lib.dsa_set_exchange_wide_merge.argtypes = [i64, i32, cp, i32]
    lib.dsa_merge_uses_wide.restype = i32
    lib.dsa_merge_uses_wide.argtypes = [i32, i32]
    lib.dsa_set_exchange_lean_producer.restype = i32
    lib.dsa_set_exchange_lean_producer.argtypes = [i64, i32, cp]
    lib.dsa_producer_uses_lean.restype = i32
    lib.dsa_producer_uses_lean.argtypes = [i32, i32, i32]
    lib.dsa_producer_lean_cluster.restype = i32
    lib.dsa_producer_lean_cluster.argtypes = [i32, i32, i32, i32, i32, i32]
    lib.dsa_num_exchanges.restype = i32
    lib.dsa_num_exchanges.argtypes = []
    lib.dsa_launch_count.restype = ctypes.c_int64
    lib.dsa_launch_count.argtypes = []
    lib.dsa_ffi_api_version.restype = i32
    lib.dsa_ffi_api_version.argtypes = []


def runtime_ffi_api_version() -> tuple[int, int] | None:
    """XLA FFI API (major, minor) of the running jaxlib, read from its bundled headers."""
    try:
        text = open(os.path.join(jax.ffi.include_dir(), "xla", "ffi", "api", "c_api.h")).read()
    except OSError:
        return None
    major = re.search(r"#define XLA_FFI_API_MAJOR (\d+)", text)
    minor = re.search(r"#define XLA_FFI_API_MINOR (\d+)", text)
    return (int(major.group(1)), int(minor.group(1))) if major and minor else None


def _compatible(lib: ctypes.CDLL, path: str) -> str | None:
    """None if XLA will accept the library's handlers, else why not."""
    built = divmod(int(lib.dsa_ffi_api_version()), 1000)
    running = runtime_ffi_api_version()
    if running is None or (built[0] == running[0] and built[1] <= running[1]):
        return None
    return (
        f"{path} was built against XLA FFI API {built[0]}.{built[1]} (a newer jax) but jax {jax.__version__} "
        f"speaks {running[0]}.{running[1]}: XLA would not register its handlers.  Rebuild it against the "
        "installed jax: `pip install --no-build-isolation .` (or cmake -S ffi -B build/ffi)"
    )


def _layout_mismatch(lib: ctypes.CDLL, path: str) -> str | None:
    """None if the library's status codes and state offsets are layout.py's, else which differ."""
    from . import layout

    got = {k: int(lib.dsa_layout_constant(k.encode())) for k in layout.launcher_constants()}
    bad = {k: (got[k], v) for k, v in layout.launcher_constants().items() if got[k] != v}
    if not bad:
        return None
    return f"{path} disagrees with layout.py on {bad} (launcher, layout.py): rebuild it from this checkout"


def library() -> ctypes.CDLL | None:
    """The loaded library, or None when it was not found/loadable (see :func:`load_error`)."""
    global _lib, _load_error, _found_unusable
    with _lock:
        if _lib is not None or _load_error is not None:
            return _lib
        errors = []
        for path in candidate_paths():
            if not os.path.isfile(path):
                continue
            try:
                lib = ctypes.CDLL(path)
                _declare(lib)
            except (OSError, AttributeError) as e:
                errors.append(f"{path}: {e}")
                continue
            why = _compatible(lib, path) or _layout_mismatch(lib, path)
            if why:
                errors.append(why)
                continue
            _lib = lib
            return _lib
        _found_unusable = bool(errors)
        _load_error = (
            f"{LIB_NAME} not found or not loadable"
            + (f" ({'; '.join(errors)})" if errors else "")
            + ": build it with `pip install .` (needs cuda.h) or `cmake -S ffi -B build/ffi && "
            "cmake --build build/ffi`, or set JAX_DSA_EXCHANGE_FFI_LIB"
        )
        return None


def library_path() -> str | None:
    """The file the launcher library was loaded from, None when it was not (dev/build_cubins.py
    copies a build of it into build/ffi_lib)."""
    lib = library()
    return None if lib is None else lib._name


def found_unusable() -> bool:
    """True when a library file was found but could not be loaded or is too new for this jax."""
    library()
    return _found_unusable


def load_error() -> str | None:
    library()
    return _load_error


def available() -> bool:
    """True when the launcher library is loaded (a GPU is not required for this)."""
    return library() is not None


def driver_available() -> bool:
    """True when the library could open and initialise libcuda."""
    lib = library()
    return bool(lib is not None and lib.dsa_driver_available())


def _require() -> ctypes.CDLL:
    lib = library()
    if lib is None:
        raise RuntimeError(_load_error)
    return lib


def _check(lib: ctypes.CDLL, rc: int) -> int:
    if rc < 0:
        raise RuntimeError(lib.dsa_last_error().decode(errors="replace"))
    return rc


GRAPH_MODES = ("on", "off", "checked")


def cuda_graph_mode() -> str:
    """Which handlers XLA may record into CUDA graphs (``JAX_DSA_EXCHANGE_CUDA_GRAPHS``,
    read once, at registration):

    * ``on`` (default; also ``1``): both custom calls.  Graph replays skip the handlers, so
      the host learns of a failure from the pinned status copy the merge kernel writes when
      the status is set (graphs or not): ``op.jit`` polls it before each dispatch
      (``Exchange.poll``), ``Exchange.check()`` reads the device words; the kernels
      themselves refuse any work once the status is set, so a replay never waits or writes
      to a peer after a failure or a close.
    * ``checked``: the merge may be recorded, select_push never is, so its handler (and its
      status check: a failed exchange raises on the next call, whatever jit compiled it)
      runs on every call; XLA splits its graphs around it, which costs 4.5-5.8 us per call
      in the serving loop of ``python -m jax_dsa_exchange.bench --serving`` (H200).
    * ``off`` (also ``0``): neither; XLA calls both handlers on every execution.
    """
    v = os.environ.get("JAX_DSA_EXCHANGE_CUDA_GRAPHS", "on").strip().lower()
    v = {"1": "on", "true": "on", "yes": "on", "0": "off", "false": "off", "no": "off"}.get(v, v)
    if v not in GRAPH_MODES:
        raise ValueError(f"JAX_DSA_EXCHANGE_CUDA_GRAPHS={v!r} must be one of {GRAPH_MODES}")
    return v


def cuda_graphs_enabled() -> bool:
    """True unless ``JAX_DSA_EXCHANGE_CUDA_GRAPHS`` is off (see :func:`cuda_graph_mode`)."""
    return cuda_graph_mode() != "off"


def register_targets() -> bool:
    """Registers the FFI targets with XLA (CUDA platform) once; False without the library."""
    global _registered
    lib = library()
    if lib is None:
        return False
    with _lock:
        if _registered:
            return True
        mode = cuda_graph_mode()
        from ._jax_private import custom_call_target_traits

        # XLA also takes the traits from the registration; keep both in agreement.
        traits = custom_call_target_traits()
        for name in TARGETS:
            graphed = mode == "on" or (mode == "checked" and name == "dsa_merge")
            symbol = (TARGETS if graphed else TARGETS_NO_GRAPH)[name]
            kwargs = {}
            if traits is not None:
                kwargs["traits"] = traits.COMMAND_BUFFER_COMPATIBLE if graphed else traits.DEFAULT
            capsule = jax.ffi.pycapsule(getattr(lib, symbol))
            jax.ffi.register_ffi_target(name, capsule, platform="CUDA", api_version=1, **kwargs)
        _registered = True
    return True


def load_kernel(key: str, kernel: str, params, cubin: bytes | None, ptx: str | None, entry: str, device: int,
                block: int, smem: int, arch: str | None = None) -> str:
    """Loads kernel ``entry`` into the primary context of CUDA device ``device``, once per (key, device).

    ``kernel``: ``"select_push"`` or ``"merge"``; ``params``: its metadata's
    ``((name, type), ...)`` in launch order (kernels/abi.py): the launcher packs its
    values by these names and refuses names other than its own.
    Tries ``cubin`` first and JIT-compiles ``ptx`` when the driver refuses it.
    ``block``: threads per block; ``smem``: dynamic shared memory bytes.  ``arch``: the
    target the image was built for (its metadata's, e.g. ``"sm_90a"``); the launcher refuses
    it, naming the device's own target and the build command, on a device of another compute
    capability (None: not checked).
    Returns ``"cubin"`` or ``"ptx"``: which image was used.
    """
    lib = _require()
    cubin = bytes(cubin or b"")
    buf = ctypes.create_string_buffer(cubin, len(cubin)) if cubin else None
    ptx_b = ptx.encode() if ptx else None
    spec = ",".join(f"{n}:{t}" for n, t in params)
    rc = lib.dsa_load_kernel(
        key.encode(), kernel.encode(), spec.encode(), buf, len(cubin), ptx_b, entry.encode(), int(device),
        int(block), int(smem), arch.encode() if arch else None
    )
    return {1: "cubin", 2: "ptx"}[_check(lib, rc)]


def launcher_params(kernel: str) -> tuple:
    """The ((name, type), ...) the launcher fills for ``kernel``, in its own order."""
    spec = _require().dsa_launcher_params(kernel.encode()).decode()
    return tuple(tuple(item.split(":")) for item in spec.split(",") if item)


def layout_constants() -> dict:
    """The launcher's layout numbers by their layout.py names (layout.launcher_constants())."""
    lib = _require()
    from . import layout

    return {name: int(lib.dsa_layout_constant(name.encode())) for name in layout.launcher_constants()}


_SPLIT_KEYS = ("slice_max", "cluster_max", "min_slice", "fill_ctas")
_CACHE_KEYS = ("cache_max", "cache_wide")  # (cache_max 0: the launcher passes cache_tokens 0, smem as built)


def set_kernel_split(key: str, device: int, split: dict) -> None:
    """Tells the launcher how select_push splits rows and caches slices (the metadata's
    ``split``, layout.producer_split()); call after load_kernel, before register_exchange."""
    lib = _require()
    vals = [int(split[k]) for k in _SPLIT_KEYS] + [int(split.get(k, 0)) for k in _CACHE_KEYS]
    _check(lib, lib.dsa_set_kernel_split(key.encode(), int(device), *vals))


def _fit_arg(split: dict):
    """The split's ``cluster_fit`` as the launcher's int[PRODUCER_CLUSTER_MAX] (-1 padded), or
    None (unknown)."""
    from . import layout

    fit = split.get("cluster_fit")
    if fit is None:
        return None
    vals = [max(-1, min(int(x), 2**31 - 1)) for x in fit][: layout.PRODUCER_CLUSTER_MAX]
    vals += [-1] * (layout.PRODUCER_CLUSTER_MAX - len(vals))
    return (ctypes.c_int * layout.PRODUCER_CLUSTER_MAX)(*vals)


def producer_cluster(rows: int, cols: int, split: dict) -> int:
    """The launcher's CTAs per row for [rows, cols] (must equal layout.producer_cluster)."""
    vals = [int(split[k]) for k in _SPLIT_KEYS] + [int(split.get(k, 0)) for k in _CACHE_KEYS]
    return int(_require().dsa_producer_cluster(int(rows), int(cols), *vals, _fit_arg(split)))


def producer_cache_tokens(rows: int, cols: int, c: int, split: dict) -> int:
    """The launcher's cache_tokens for [rows, cols] at cluster size c (must equal
    layout.producer_cache_tokens)."""
    vals = [int(split[k]) for k in _SPLIT_KEYS] + [int(split.get(k, 0)) for k in _CACHE_KEYS]
    return int(_require().dsa_producer_cache_tokens(int(rows), int(cols), int(c), *vals, _fit_arg(split)))


def set_kernel_cluster(key: str, device: int, cluster: int) -> int:
    """Tells the launcher that the loaded merge ``key`` runs one cluster of ``cluster`` CTAs
    per row (its metadata's ``cluster``); call after load_kernel, before register_exchange.
    Returns the clusters of that size the device runs at once (-1: unknown)."""
    lib = _require()
    fit = ctypes.c_int(-1)
    _check(lib, lib.dsa_set_kernel_cluster(key.encode(), int(device), int(cluster), ctypes.byref(fit)))
    return int(fit.value)


def kernel_cluster_fit(key: str, device: int) -> tuple:
    """The co-resident cluster counts the launcher measured for a loaded select_push kernel
    when its split was set (layout.producer_cluster_fit's ``cluster_fit``; -1 = unknown)."""
    from . import layout

    lib = _require()
    out = (ctypes.c_int * layout.PRODUCER_CLUSTER_MAX)()
    _check(lib, lib.dsa_kernel_cluster_fit(key.encode(), int(device), out))
    return tuple(int(x) for x in out)


def register_exchange(
    exchange_id: int,
    device: int,
    *,
    rank: int,
    world: int,
    topk: int,
    local_topk: int,
    max_rows: int,
    peers: int,
    local: int,
    state: int,
    rescue_off: int,
    flags_off: int,
    timeout_us: int,
    merge_grid: int,
    select_key: str,
    merge_key: str,
    host_status: int = 0,
) -> None:
    """Registers the per-rank constants of one exchange on CUDA device ``device``.

    ``peers``: device address of an int64[world] table of every rank's symmetric
    buffer base; ``local``: this rank's buffer base; ``state``: this rank's int32
    state (epoch at byte 0).  Both kernels must have been loaded on ``device``.
    ``host_status``: address of 4 * layout.STATUS_REPORT_WORDS bytes of pinned host memory (0 = none): the
    merge kernel writes the state's status words there when the status is set, and every
    handler call first reads them, so a failure of an earlier call (a peer that did not
    arrive) fails the next call with a Python error naming row, epoch and rank; it must
    stay allocated as long as a CUDA graph may replay the calls (Exchange keeps it).
    """
    lib = _require()
    rc = lib.dsa_register_exchange(
        int(exchange_id), int(device), int(rank), int(world), int(topk), int(local_topk), int(max_rows),
        int(peers), int(local), int(state), int(rescue_off), int(flags_off), int(timeout_us),
        int(merge_grid), select_key.encode(), merge_key.encode(), int(host_status),
    )
    _check(lib, rc)


def set_exchange_wide_merge(exchange_id: int, device: int, key: str, wide_grid: int) -> None:
    """Gives the registered exchange its configuration's merge_wide image (``key``: loaded, its
    clusters set with set_kernel_cluster, wider than the merge's) and the clusters of it each
    launch may hold at once (``wide_grid`` >= 1): a merge over rows <= wide_grid then runs it
    (layout.merge_uses_wide)."""
    lib = _require()
    _check(lib, lib.dsa_set_exchange_wide_merge(int(exchange_id), int(device), key.encode(), int(wide_grid)))


def merge_uses_wide(rows: int, wide_grid: int) -> bool:
    """The launcher's choice of merge image (must equal layout.merge_uses_wide)."""
    return bool(_require().dsa_merge_uses_wide(int(rows), int(wide_grid)))


def set_exchange_lean_producer(exchange_id: int, device: int, key: str) -> None:
    """Gives the registered exchange its configuration's lean producer image (``key``: a loaded
    select_push kernel whose split was set: its slice_max is the longest slice it takes): a
    select_push launch whose slices all fit it then runs it (layout.producer_uses_lean)."""
    lib = _require()
    _check(lib, lib.dsa_set_exchange_lean_producer(int(exchange_id), int(device), key.encode()))


def producer_uses_lean(cols: int, c: int, lean_slice_max: int) -> bool:
    """The launcher's choice of producer image (must equal layout.producer_uses_lean)."""
    return bool(_require().dsa_producer_uses_lean(int(cols), int(c), int(lean_slice_max)))


def producer_lean_cluster(rows: int, cols: int, c: int, lean_split: dict) -> int:
    """The launcher's CTAs per row of a launch on the lean image (must equal
    layout.producer_lean_cluster)."""
    return int(_require().dsa_producer_lean_cluster(int(rows), int(cols), int(c), int(lean_split["cluster_max"]),
                                                    int(lean_split["min_slice"]), int(lean_split["fill_ctas"])))


def unregister_exchange(exchange_id: int, device: int) -> None:
    """Forgets the record of (exchange_id, device); calls compiled for it fail afterwards."""
    lib = _require()
    _check(lib, lib.dsa_unregister_exchange(int(exchange_id), int(device)))


def num_exchanges() -> int:
    """Registered (exchange, device) records."""
    return int(_require().dsa_num_exchanges())


def launch_count() -> int:
    """Kernel launches made by the FFI handlers in this process (diagnostic: a handler
    recorded into a CUDA graph runs once at capture, then the graph replays the kernel)."""
    return int(_require().dsa_launch_count())


register_targets()
