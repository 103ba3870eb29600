"""Compile, store and find the two kernels' cubins (no JAX, no CUDA import).

A configuration is (arch, world W, topk K, local_topk N, rescue list, interleave I).  Its
images are keyed by that and by the sha256 of the kernels' source files
(:data:`SOURCE_FILES`), so an edit to a kernel never loads a stale cubin.  ``arch`` is one of
layout.ARCHS: kernels of one target run on that compute capability only.

Lookup order of :func:`load_kernels`: in-memory cache, then every directory
of ``$JAX_DSA_EXCHANGE_CUBIN_DIR`` (``os.pathsep``-separated; e.g. a folder
built with ``python -m jax_dsa_exchange.build``), then the user cache
(``$JAX_DSA_EXCHANGE_CACHE`` or ``~/.cache/jax_dsa_exchange``); then compile
with the CuTe DSL when it is importable (and store into the user cache); else
a clear error naming the configuration and the build command.

On disk, per configuration: ``<dir>/<tag>/{select_push,merge}.{cubin,ptx,json}``
with ``tag = f"{arch}-w{W}-k{K}-n{N}[-rl][-i{I}]-{hash[:16]}"`` (``-rl``: the rescue list;
``-i{I}``: an interleave other than 1), and ``select_push_lean.*`` /
``merge_wide.*`` where the configuration has the lean producer / a second merge of wider
clusters (:data:`OPTIONAL`).  The JSON::

    {"kernel": "select_push" | "merge", "entry": <PTX entry symbol>,
     "params": [[name, "i64" | "i32"], ...]  (launch order),
     "block": 512 (threads per CTA, 1-D), "smem": <dynamic shared bytes>,
     "config": {"world": W, "topk": K, "local_topk": N, "rescue_list": bool, "interleave": I},
     "arch": "sm_90a", "source_hash": <sha256 hex>, "grid": <how to size it>,
     "cluster": C (merge, merge_wide: only where C > 1: every launch in clusters of C CTAs),
     "compile_seconds": <float>, "cubin": <file>, "ptx": <file>}

Loading on the device: keep the cubin and the PTX; if the driver refuses the
cubin (it was built by a newer toolkit), load the PTX (driver JIT).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import tempfile
import time

from .. import layout

KERNELS = ("select_push", "merge")
# Images a configuration may have besides KERNELS.  merge_wide: the same merge (kernel "merge",
# the same ABI) with rows over clusters of up to merge.CLUS_WIDE CTAs (of at least merge.WIDE_KP
# words per thread), built where the merge is clustered and that is wider; the launcher runs it instead of the merge when every row of a
# call has its own cluster at once (layout.merge_uses_wide).  Written before merge.json, whose
# presence marks a folder complete.
# select_push_lean: select_push with the lean select (kernels/lean.py), built where the configuration
# allows it (select_push.producer_configs); the launcher runs it instead of select_push when every
# slice of a launch fits it (layout.producer_uses_lean).
OPTIONAL = ("select_push_lean", "merge_wide")
KIND = {"select_push": "select_push", "select_push_lean": "select_push", "merge": "merge",
        "merge_wide": "merge"}  # image -> kernel (ABI)
_HERE = pathlib.Path(__file__).resolve().parent
SOURCE_FILES = (
    _HERE / "abi.py",
    _HERE / "ptx.py",
    _HERE / "common.py",
    _HERE / "select.py",
    _HERE / "lean.py",
    _HERE / "select_push.py",
    _HERE / "merge.py",
    _HERE.parent / "layout.py",
)
DEFAULT_ARCH = "sm_90a"
ENV_DIRS = "JAX_DSA_EXCHANGE_CUBIN_DIR"
ENV_CACHE = "JAX_DSA_EXCHANGE_CACHE"

GRID_DOC = {
    "select_push": "(rows * C, 1, 1) in clusters of (C, 1, 1), C = layout.producer_cluster(rows, "
    "cols, split) from the metadata's split and the device's count of co-resident clusters: "
    "cluster b selects and pushes row b",
    "merge": "(G * C, 1, 1) in clusters of (C, 1, 1), C = the metadata's cluster (1 when absent), "
    "1 <= G <= rows, small enough that the W ranks' merge grids are co-resident on their GPUs "
    "(docs/DESIGN.md §6.7; C > 1: G at most the device's co-resident clusters of C): cluster b "
    "does rows b, b+G, ...; where the configuration has a merge_wide image, that one instead "
    "(the same rule, its own C and G) when layout.merge_uses_wide(rows, its G)",
}


def cubin_resources(cubin: bytes) -> dict:
    """{"registers", "frame_bytes", "text_bytes"} of the (one) kernel of a cubin, from its ELF
    ``.nv.info`` attributes (EIATTR_REGCOUNT 0x2f, EIATTR_FRAME_SIZE 0x11: what ``ptxas -v``
    prints as registers and stack frame) and the size of its ``.text.`` section (its SASS),
    readable without a toolkit (tests/test_kernels_compile.py)."""
    import struct

    if cubin[:4] != b"\x7fELF" or cubin[4] != 2:
        raise ValueError("not a 64-bit ELF cubin")
    shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)

    def header(i):  # (name, type, flags, addr, offset, size, ...)
        return struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize)

    names = header(shstrndx)
    out = {}
    for i in range(shnum):
        h = header(i)
        start = names[4] + h[0]
        name = cubin[start:cubin.index(b"\0", start)]
        if name.startswith(b".text."):
            out["text_bytes"] = h[5]
        if name != b".nv.info":
            continue
        data, j = cubin[h[4]:h[4] + h[5]], 0
        while j + 4 <= len(data):
            fmt, attr, size = struct.unpack_from("<BBH", data, j)
            if fmt != 4:  # no value: the 16-bit field is the value itself
                j += 4
                continue
            if attr in (0x2F, 0x11) and size == 8:
                key = "registers" if attr == 0x2F else "frame_bytes"
                out[key] = struct.unpack_from("<I", data, j + 8)[0]
            j += 4 + size
    if "registers" not in out:
        raise ValueError("no EIATTR_REGCOUNT in the cubin")
    out.setdefault("frame_bytes", 0)
    return out


def cubin_sm(cubin: bytes) -> int:
    """The SM version a cubin was built for (90 for sm_90a, 100 for sm_100a, 103 for sm_103a),
    from its ELF header's e_flags, whose layout the header's ABI version (byte 8) gives."""
    import struct

    if cubin[:4] != b"\x7fELF" or cubin[4] != 2:
        raise ValueError("not a 64-bit ELF cubin")
    flags = struct.unpack_from("<I", cubin, 0x30)[0]
    return (flags >> 8) & 0xFF if cubin[8] >= 8 else flags & 0xFF


@dataclasses.dataclass(frozen=True)
class KernelImage:
    """One compiled kernel, ready for cuModuleLoadData + cuLaunchKernel."""

    kernel: str
    entry: str
    cubin: bytes
    ptx: str
    block: int  # threads per CTA (block = (block, 1, 1))
    smem: int
    params: tuple  # ((name, "i64" | "i32"), ...)
    config: dict
    arch: str
    source_hash: str
    split: dict | None = None  # select_push: layout.producer_split() it was built for
    cluster: int = 1  # merge: CTAs per row, launched as clusters of (cluster, 1, 1) (Merge.clus)

    def metadata(self) -> dict:
        meta = {
            "kernel": self.kernel, "entry": self.entry,
            "params": [list(p) for p in self.params], "block": self.block,
            "smem": self.smem, "config": dict(self.config), "arch": self.arch,
            "source_hash": self.source_hash, "grid": GRID_DOC[self.kernel],
        }  # fmt: skip
        if self.split is not None:
            meta["split"] = dict(self.split)
        if self.cluster > 1:
            meta["cluster"] = self.cluster
        return meta


def source_hash(files=SOURCE_FILES) -> str:
    """sha256 of the kernels' source files: with the configuration, all a cubin's tag derives from."""
    h = hashlib.sha256()
    for f in files:
        h.update(pathlib.Path(f).name.encode() + b"\0")
        h.update(pathlib.Path(f).read_bytes())
        h.update(b"\0")
    return h.hexdigest()


def config_tag(arch: str, world: int, topk: int, local_topk: int, shash: str,
               rescue_list: bool = False, interleave: int = 1) -> str:
    return (f"{arch}-w{world}-k{topk}-n{local_topk}{'-rl' if rescue_list else ''}"
            f"{f'-i{interleave}' if interleave != 1 else ''}-{shash[:16]}")


def build_command(arch, world, topk, local_topk, out="DIR", rescue_list=False, interleave=1) -> str:
    return (f"python -m jax_dsa_exchange.build --arch {arch} --topk {topk} "
            f"--local-topk {local_topk} --world {world}{' --rescue-list' if rescue_list else ''}"
            f"{f' --interleave {interleave}' if interleave != 1 else ''} --out {out}")  # fmt: skip


def check_build(arch: str, world: int, topk: int, local_topk: int, interleave: int = 1) -> None:
    """What the kernels build for (docs/DESIGN.md §2, layout.ARCHS); TypeError / ValueError
    naming the value."""
    layout.arch_limits(arch)
    layout.check_config(world, topk, local_topk)
    layout.check_kernel_interleave(interleave, world)


def cutlass_available() -> bool:
    try:
        import cutlass.cute  # noqa: F401
    except Exception:
        return False
    return True


# ------------------------------------------------------------------ compile

_COMPILED: dict = {}  # (kernel, arch, W, K, N, rescue_list, I) -> (compiled object, seconds)


def _kernel_object(kernel: str, world: int, topk: int, local_topk: int, rescue_list: bool = False,
                   interleave: int = 1, arch: str = DEFAULT_ARCH):
    """The kernel object of one image: its static configuration, compile() and metadata.  The
    producer works on local indices only, so its images are the same at every interleave."""
    if kernel in ("select_push", "select_push_lean"):
        from .select_push import ProducerConfig, SelectPush

        return SelectPush(ProducerConfig(world, topk, local_topk, rescue_list, lean=kernel == "select_push_lean",
                                         arch=arch))
    from .merge import Merge, MergeConfig

    config = MergeConfig(world, topk, local_topk, rescue_list, interleave=interleave, arch=arch)
    return Merge(config.wide() if kernel == "merge_wide" else config)


def producer_images(world: int, topk: int, local_topk: int, rescue_list: bool = False) -> tuple:
    """The configuration's producer images (needs the CuTe DSL: the kernels' own rule,
    select_push.producer_configs): select_push, and select_push_lean where it has the lean one."""
    from .select_push import producer_configs

    return tuple(c.image for c in producer_configs(world, topk, local_topk, rescue_list))


def has_lean_producer(world: int, topk: int, local_topk: int, rescue_list: bool = False) -> bool:
    """Whether the configuration gets a select_push_lean image."""
    return "select_push_lean" in producer_images(world, topk, local_topk, rescue_list)


def has_wide_merge(world: int, topk: int, local_topk: int, rescue_list: bool = False) -> bool:
    """Whether the configuration gets a merge_wide image: its merge is clustered and the wide
    image's clusters are wider (needs the CuTe DSL: the kernels' own rule, Merge.clus)."""
    m = _kernel_object("merge", world, topk, local_topk, rescue_list).clus
    return m > 1 and _kernel_object("merge_wide", world, topk, local_topk, rescue_list).clus > m


def compiled_key(kernel: str, arch: str, world: int, topk: int, local_topk: int, rescue_list: bool = False,
                 interleave: int = 1) -> tuple:
    """The key of one image in this process's compile cache (whether it compiled already); the
    producer's images do not depend on the interleave, so every I shares them."""
    return (kernel, arch, world, topk, local_topk, bool(rescue_list), 1 if KIND[kernel] == "select_push" else interleave)


def compile_kernel(kernel: str, arch: str, world: int, topk: int, local_topk: int,
                   rescue_list: bool = False, interleave: int = 1):
    """The CuTe DSL compiled object, cached on the static config only."""
    key = compiled_key(kernel, arch, world, topk, local_topk, rescue_list, interleave)
    if key not in _COMPILED:
        obj = _kernel_object(kernel, world, topk, local_topk, bool(rescue_list), interleave, arch)
        t0 = time.perf_counter()
        # a private dump directory (common.compile_options): the DSL writes the PTX and
        # cubin there and reads them back before compile() returns
        with tempfile.TemporaryDirectory(prefix="dsa_cute_") as dump_dir:
            compiled = obj.compile(arch, dump_dir)
        _COMPILED[key] = (obj, compiled, time.perf_counter() - t0)
    return _COMPILED[key]


def compile_images(arch: str, world: int, topk: int, local_topk: int, rescue_list: bool = False,
                   interleave: int = 1) -> dict:
    """Compile both kernels (and merge_wide where the configuration has it) -> {name:
    (KernelImage, compile seconds)}, merge last."""
    check_build(arch, world, topk, local_topk, interleave)
    from .abi import KERNELS as ABIS
    from .common import TB

    shash = source_hash()
    out = {}
    names = (producer_images(world, topk, local_topk, rescue_list)
             + (("merge_wide",) if has_wide_merge(world, topk, local_topk, rescue_list) else ()) + ("merge",))
    for name in names:
        obj, compiled, secs = compile_kernel(name, arch, world, topk, local_topk, rescue_list, interleave)
        entries = list(compiled.kernel_info)
        if len(entries) != 1:
            raise RuntimeError(f"{name}: expected one kernel entry, got {entries}")
        img = KernelImage(
            kernel=KIND[name], entry=entries[0], cubin=bytes(compiled.__cubin__),
            ptx=str(compiled.__ptx__), block=TB, smem=int(obj.smem),
            params=ABIS[KIND[name]].pairs(),
            config={"world": world, "topk": topk, "local_topk": local_topk,
                    "rescue_list": bool(rescue_list), "interleave": interleave},
            arch=arch, source_hash=shash,
            split=obj.split() if KIND[name] == "select_push" else None,
            cluster=int(getattr(obj, "clus", 1)),
        )  # fmt: skip
        out[name] = (img, secs)
    return out


# ------------------------------------------------------------------ disk


def write_images(images: dict, out_dir) -> pathlib.Path:
    """images: {name: KernelImage or (KernelImage, secs)} -> folder written."""
    first = next(iter(images.values()))
    first = first[0] if isinstance(first, tuple) else first
    c = first.config
    d = pathlib.Path(out_dir) / config_tag(first.arch, c["world"], c["topk"], c["local_topk"],
                                           first.source_hash, c.get("rescue_list", False),
                                           c.get("interleave", 1))  # fmt: skip
    d.mkdir(parents=True, exist_ok=True)
    for name, v in images.items():
        img, secs = v if isinstance(v, tuple) else (v, None)
        (d / f"{name}.cubin").write_bytes(img.cubin)
        (d / f"{name}.ptx").write_text(img.ptx)
        meta = img.metadata()
        meta.update(cubin=f"{name}.cubin", ptx=f"{name}.ptx", compile_seconds=secs)
        tmp = d / f".{name}.json.tmp{os.getpid()}"
        tmp.write_text(json.dumps(meta, indent=1))
        tmp.replace(d / f"{name}.json")  # json last: a folder with json is complete
    return d


def read_packed(path) -> bytes:
    """A prebuilt file's bytes, or those of its gzip copy ``<name>.gz`` (dev/pack_cubins.sh
    gzips the PTX and the cubins of a folder: ~3x smaller)."""
    path = pathlib.Path(path)
    if path.is_file():
        return path.read_bytes()
    import gzip

    gz = path.with_name(path.name + ".gz")
    if gz.is_file():
        return gzip.decompress(gz.read_bytes())
    raise FileNotFoundError(f"{path} (nor {gz.name})")


def read_images(folder) -> dict:
    d = pathlib.Path(folder)
    out = {}
    for name in KERNELS + tuple(n for n in OPTIONAL if (d / f"{n}.json").is_file()):
        meta = json.loads((d / f"{name}.json").read_text())
        out[name] = KernelImage(
            kernel=meta["kernel"], entry=meta["entry"],
            cubin=read_packed(d / meta["cubin"]), ptx=read_packed(d / meta["ptx"]).decode(),
            block=int(meta["block"][0] if isinstance(meta["block"], list) else meta["block"]),
            smem=int(meta["smem"]),
            params=tuple(tuple(p) for p in meta["params"]), config=meta["config"],
            arch=meta["arch"], source_hash=meta["source_hash"], split=meta.get("split"),
            cluster=int(meta.get("cluster", 1)),
        )  # fmt: skip
    return out


def search_dirs() -> list:
    dirs = [p for p in os.environ.get(ENV_DIRS, "").split(os.pathsep) if p]
    dirs.append(user_cache_dir())
    return [pathlib.Path(p) for p in dirs]


def user_cache_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get(ENV_CACHE) or
                        pathlib.Path.home() / ".cache" / "jax_dsa_exchange")  # fmt: skip


_LOADED: dict = {}


def load_kernels(arch: str, world: int, topk: int, local_topk: int, *, allow_compile=True,
                 rescue_list: bool = False, interleave: int = 1) -> dict:
    """{"select_push": KernelImage, "merge": KernelImage, ...} of one config (``rescue_list``: the
    producer also makes each row's K-list, which a rescue then pushes; kernels/select.py;
    ``interleave``: the KV cache's interleave size, which the merge's global positions take)."""
    check_build(arch, world, topk, local_topk, interleave)
    rescue_list = bool(rescue_list)
    shash = source_hash()
    key = (arch, world, topk, local_topk, shash, rescue_list, interleave)
    if key in _LOADED:
        return _LOADED[key]
    tag = config_tag(arch, world, topk, local_topk, shash, rescue_list, interleave)
    for d in search_dirs():
        folder = d / tag
        if all((folder / f"{n}.json").is_file() for n in KERNELS):
            imgs = read_images(folder)
            _LOADED[key] = imgs
            return imgs
    if allow_compile and cutlass_available():
        built = compile_images(arch, world, topk, local_topk, rescue_list, interleave)
        try:
            write_images(built, user_cache_dir())
        except OSError:
            pass  # a read-only home still gets the in-memory images
        imgs = {n: v[0] for n, v in built.items()}
        _LOADED[key] = imgs
        return imgs
    others = sorted(prebuilt_archs(world, topk, local_topk, rescue_list, interleave, shash) - {arch})
    raise FileNotFoundError(
        f"no prebuilt kernels for arch={arch} world={world} topk={topk} "
        f"local_topk={local_topk}{f' interleave={interleave}' if interleave != 1 else ''} "
        f"(source hash {shash[:16]}, folder {tag}) in "
        f"{[str(d) for d in search_dirs()]}"
        f"{f' (found for {others} only)' if others else ''}, and the CuTe DSL (nvidia-cutlass-dsl) is "
        f"{'not importable' if not cutlass_available() else 'disabled'} here. Build them on "
        f"any machine with: {build_command(arch, world, topk, local_topk, rescue_list=rescue_list, interleave=interleave)}"
        f" and point {ENV_DIRS} at DIR."
    )


def prebuilt_archs(world: int, topk: int, local_topk: int, rescue_list: bool = False, interleave: int = 1,
                   shash: str | None = None) -> set:
    """The targets the search folders hold this configuration's images for (of this source)."""
    shash = shash or source_hash()
    found = set()
    for arch in layout.ARCHS:
        tag = config_tag(arch, world, topk, local_topk, shash, rescue_list, interleave)
        if any(all((d / tag / f"{n}.json").is_file() for n in KERNELS) for d in search_dirs()):
            found.add(arch)
    return found
