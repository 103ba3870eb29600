"""The CuTe DSL kernels compile for sm_90a without a GPU, their PTX carries
the protocol's memory operations, the metadata matches the launcher ABI, and
the cache finds / rejects images by config and source hash."""

from __future__ import annotations

import json
import pathlib
import re

import pytest

from jax_dsa_exchange import layout
from jax_dsa_exchange.kernels import abi, cache

pytestmark = pytest.mark.skipif(not cache.cutlass_available(),
                                reason="nvidia-cutlass-dsl (CuTe DSL) is not installed")

# fast path (words in registers, W*N <= 32*512; W=16 N=1024 is exactly 32 per thread),
# keys re-read from memory (16*2048), N == K, the benchmarks' main configuration
CONFIGS = [(8, 256, 64), (16, 2048, 1024), (16, 4096, 2048), (4, 128, 128), (8, 2048, 512)]

SMEM_OPT_IN_MAX = 232448  # dynamic shared memory one Hopper CTA may opt in to (227 KB)


@pytest.fixture(scope="module", params=CONFIGS, ids=lambda c: "w%d-k%d-n%d" % c)
def images(request):
    w, k, n = request.param
    return cache.compile_images("sm_90a", w, k, n)


def _entry_params(ptx: str, entry: str) -> list:
    m = re.search(r"\.entry\s+" + re.escape(entry) + r"\s*\((.*?)\)", ptx, re.S)
    assert m, "entry not in PTX"
    return re.findall(r"\.param\s+\.(u64|u32|b64|b32|s64|s32)\s", m.group(1))


def test_compiles_to_sm90a(images):
    for name, (img, secs) in images.items():
        assert img.cubin[:4] == b"\x7fELF", name
        assert ".target sm_90a" in img.ptx, name
        assert img.block == 512 and 0 < img.smem <= SMEM_OPT_IN_MAX
        print(f"{name} {img.config}: compiled in {secs:.1f}s")


def test_no_ptxas_spill_mode(images):
    """ptxas sometimes gives a large kernel 32 registers and a stack frame of hundreds of
    bytes (a W = 16 N = 1024 merge build: 45.7 -> 72 us on the H200): the
    kernels keep their registers, and any stack frame stays small."""
    for name, (img, _) in images.items():
        r = cache.cubin_resources(img.cubin)
        print(f"{name} {img.config}: {r}")
        assert r["frame_bytes"] <= 512, (name, img.config, r)
        assert r["registers"] > 32 or r["frame_bytes"] == 0, (name, img.config, r)


def test_cubin_resources_reads_regcount_and_frame():
    import struct

    def nv_info(attrs):
        return b"".join(struct.pack("<BBHII", 4, a, 8, 7, v) for a, v in attrs)

    def elf(info):  # minimal ELF64: null, .shstrtab, .nv.info
        names = b"\0.shstrtab\0.nv.info\0"
        body = names + info
        shoff = 64 + len(body)
        hdr = bytearray(64)
        hdr[:5] = b"\x7fELF\x02"
        struct.pack_into("<Q", hdr, 0x28, shoff)
        struct.pack_into("<HHH", hdr, 0x3A, 64, 3, 1)
        sh = bytes(64) + struct.pack("<IIQQQQIIQQ", 1, 3, 0, 0, 64, len(names), 0, 0, 1, 0) + struct.pack(
            "<IIQQQQIIQQ", 11, 0x70000000, 0, 0, 64 + len(names), len(info), 0, 0, 4, 0)
        return bytes(hdr) + body + sh

    assert cache.cubin_resources(elf(nv_info([(0x2F, 125), (0x11, 0)]))) == {"registers": 125, "frame_bytes": 0}
    assert cache.cubin_resources(elf(nv_info([(0x11, 648), (0x2F, 32)]))) == {"registers": 32, "frame_bytes": 648}
    with pytest.raises(ValueError):
        cache.cubin_resources(b"not an elf")


def test_ptx_protocol_instructions(images):
    sp, mg = images["select_push"][0].ptx, images["merge"][0].ptx
    # LL push: 16-byte volatile stores (w0, e, w1, e) as two 64-bit elements (each half
    # single-copy atomic, as the merge reads it); never 32-bit elements; PDL trigger + wait
    assert re.search(r"st\.volatile\.global\.v2\.u64", sp)
    assert not re.search(r"st\.volatile\.global\.v4\.u32", sp + mg)
    assert "griddepcontrol.launch_dependents" in sp and "griddepcontrol.wait" in sp
    # the row split over a cluster: histograms through distributed shared memory, read
    # after relaxed cluster barriers that release this CTA's own shared memory; each CTA
    # pushes its own part of the row (edge words as one 8-byte store each), so no CTA stores
    # into another's shared memory; the last barrier is an arrival + a wait before exit
    assert "fence.release.sync_restrict::shared::cta.cluster" in sp
    assert "barrier.cluster.arrive.relaxed.aligned" in sp and "barrier.cluster.wait.aligned" in sp
    assert "barrier.cluster.arrive.release" not in sp
    assert "mapa.shared::cluster" in sp and "ld.shared::cluster.v4.u32" in sp
    assert "st.shared::cluster" not in sp and "red.relaxed.cluster" not in sp
    assert re.search(r"st\.volatile\.global\.u64", sp) and "ld.global.nc.v4.u32" in sp
    assert not re.search(r"st\.volatile\.global\.v2\.u32", sp)
    mimg = images["merge"][0]
    if mimg.cluster == 1:
        # the rescue's select runs on one CTA of the merge: no cluster instruction there
        assert "barrier.cluster" not in mg and "shared::cluster" not in mg
    else:
        # a row over a cluster (Merge.clus): every CTA reads the others' sums (DSMEM loads
        # after barriers that release its own shared memory), never stores into another CTA's;
        # a full release barrier only before CTA 0 rewrites a row the cluster wrote
        assert "fence.release.sync_restrict::shared::cta.cluster" in mg
        assert "barrier.cluster.arrive.relaxed.aligned" in mg and "barrier.cluster.wait.aligned" in mg
        assert "barrier.cluster.arrive.release.aligned" in mg
        assert "mapa.shared::cluster" in mg and "ld.shared::cluster.v4.u32" in mg
        assert "st.shared::cluster" not in mg and "red.relaxed.cluster" not in mg
    # merge: 8-byte LL halves, system-scope flag protocol, PDL wait, timeout clock
    assert re.search(r"ld\.volatile\.global\.u64", mg)
    assert "griddepcontrol.wait" in mg and "%globaltimer" in mg
    cfg0 = images["merge"][0].config
    if cfg0["world"] * cfg0["local_topk"] <= 32 * 512:
        # fast path: one 16-byte LL record per load, as two 64-bit elements (each
        # (word, tag) half is one 8-byte access whose tag is checked); no 32-bit
        # element vector loads of LL records (they could tear a half)
        assert re.search(r"ld\.volatile\.global\.v2\.u64", mg)
        assert not re.search(r"ld(\.volatile)?\.global\.v4\.u32", mg)
    cfg = images["merge"][0].config
    if layout.rescue_slots(cfg["topk"], cfg["local_topk"]) > 0:  # N == K: no rescue code
        # flags released by fence.acq_rel.sys + a strong store (st.relaxed.sys, one lane
        # per peer)
        assert "ld.acquire.sys.global.u32" in mg
        assert "st.relaxed.sys.global.u32" in mg
        assert "fence.acq_rel.sys" in mg
        assert re.search(r"st\.global\.v4\.u32", mg)  # rescue rows, 16-byte stores
    # a timeout is a status record, never a trap (the one trap of a clustered merge: a launch
    # without its cluster dimensions)
    assert mg.count("trap;") == (0 if mimg.cluster == 1 else 1)
    if "select_push_lean" in images:
        lp = images["select_push_lean"][0].ptx
        # the lean producer pushes as select_push does (its own part, 16-byte LL records and
        # 8-byte edge halves, PDL trigger), reads the other CTAs' counts after relaxed cluster
        # barriers, never stores into another CTA's shared memory; its loads are predicated
        # 16-byte read-only loads; its one trap: a launch whose slices do not fit it
        assert re.search(r"st\.volatile\.global\.v2\.u64", lp) and re.search(r"st\.volatile\.global\.u64", lp)
        assert not re.search(r"st\.volatile\.global\.v(2|4)\.u32", lp)
        assert "griddepcontrol.launch_dependents" in lp and "griddepcontrol.wait" in lp
        assert "fence.release.sync_restrict::shared::cta.cluster" in lp
        assert "barrier.cluster.arrive.relaxed.aligned" in lp and "barrier.cluster.wait.aligned" in lp
        assert "barrier.cluster.arrive.release" not in lp
        assert "ld.shared::cluster.u32" in lp and "st.shared::cluster" not in lp and "red.relaxed.cluster" not in lp
        assert re.search(r"@p ld\.global\.nc\.v4\.u32", lp)
        assert "cp.async.bulk" not in lp and lp.count("trap;") == 1


def test_metadata_matches_abi(images, tmp_path):
    d = cache.write_images(images, tmp_path)
    for name, (img, _) in images.items():
        meta = json.loads((d / f"{name}.json").read_text())
        assert [tuple(p) for p in meta["params"]] == list(abi.KERNELS[cache.KIND[name]].pairs())
        assert meta["entry"] == img.entry and meta["kernel"] == cache.KIND[name]
        assert meta["block"] == 512 and meta["smem"] == img.smem
        assert meta["arch"] == "sm_90a" and meta["source_hash"] == cache.source_hash()
        assert meta["config"] == img.config
        assert meta.get("cluster", 1) == img.cluster
        kinds = _entry_params(img.ptx, img.entry)
        assert [("i64" if k.endswith("64") else "i32") for k in kinds] == [p[1] for p in meta["params"]]
        assert (d / meta["cubin"]).read_bytes() == img.cubin
    back = cache.read_images(d)
    assert {k: v.entry for k, v in back.items()} == {k: v[0].entry for k, v in images.items()}
    # a folder whose PTX and cubins are gzipped (dev/pack_cubins.sh) reads back the same images
    import subprocess

    root = pathlib.Path(__file__).resolve().parents[1]
    subprocess.run(["bash", str(root / "dev" / "pack_cubins.sh"), str(d)], check=True, capture_output=True)
    assert not list(d.glob("*.ptx")) and not list(d.glob("*.cubin")) and list(d.glob("*.cubin.gz"))
    packed = cache.read_images(d)
    assert {k: (v.ptx, v.cubin) for k, v in packed.items()} == {k: (v.ptx, v.cubin) for k, v in back.items()}


def test_merge_cluster_of_large_rows():
    """A merge row of more than MergeConfig.min_cluster_words (merge.CLUS_KP) round-1 words per
    thread is split over a cluster of at most max_cluster (merge.CLUS_MAX) CTAs (W = 16,
    N = 1024: 32 words, 2 CTAs of 16; W = 8, N = 1024: 2 CTAs of 8); W = 8, N = 512 stays on one
    CTA.  The cluster size is in the metadata (the launchers read it there); the merge_wide
    image (MergeConfig.wide(): CLUS_WIDE CTAs of at least WIDE_KP words) where the merge's
    clusters are narrower."""
    from jax_dsa_exchange.kernels import merge
    from jax_dsa_exchange.kernels.merge import CLUS_KP, CLUS_MAX, Merge, MergeConfig

    assert CLUS_MAX == 2 and MergeConfig(8, 2048, 512).max_cluster == CLUS_MAX
    for cmax, want in ((CLUS_MAX, {(16, 2048, 1024): 2, (8, 2048, 1024): 2, (16, 2048, 512): 2,
                                   (8, 2048, 512): 1, (8, 256, 64): 1, (16, 4096, 2048): 1}),
                       (4, {(16, 2048, 1024): 4, (8, 2048, 1024): 2}), (1, {(16, 2048, 1024): 1})):
        for (w, k, n), c in want.items():
            m = Merge(MergeConfig(w, k, n, max_cluster=cmax))
            assert m.clus == c, (cmax, w, k, n, m.clus)
            if c > 1:
                assert m.kp1 >= CLUS_KP and m.kp1 * c == m.kp1_row and m.cp * c == w * n
                assert (w // c) * n == m.cp
    # fewer words per thread per clustered CTA: W = 8, N = 512 over 2 CTAs of 4 words, over 4 of
    # 2; W = 8, N = 1024 over 4 of 4; W = 16, N = 1024 over 8 of 4
    for ckp, cmax, (w, k, n), c in ((4, 2, (8, 2048, 512), 2), (2, 4, (8, 2048, 512), 4),
                                    (4, 4, (8, 2048, 1024), 4), (4, 8, (16, 2048, 1024), 8),
                                    (4, 2, (8, 256, 64), 1)):
        m = Merge(MergeConfig(w, k, n, max_cluster=cmax, min_cluster_words=ckp))
        assert m.clus == c and m.kp1 * c == m.kp1_row, (ckp, cmax, w, k, n, m.clus, m.kp1)
    imgs = cache.compile_images("sm_90a", 16, 2048, 1024)
    img = imgs["merge"][0]
    assert img.cluster == 2 and img.metadata()["cluster"] == 2
    # its second image, rows over clusters of merge.CLUS_WIDE: the same kernel and ABI, merge
    # written last (its json marks the folder complete)
    assert list(imgs) == ["select_push", "select_push_lean", "merge_wide", "merge"]
    wide = imgs["merge_wide"][0]
    assert wide.kernel == "merge" and wide.params == img.params and wide.cluster == merge.CLUS_WIDE == 4
    assert wide.metadata()["cluster"] == 4 and wide.cubin != img.cubin
    assert "cluster" not in cache.compile_images("sm_90a", 8, 2048, 512)["merge"][0].metadata()
    # which configurations have one (wider than their merge's own clusters)
    # (where the merge is clustered: W = 8, N = 1024 over 4 CTAs of merge.WIDE_KP = 4 words; not
    # W = 8, N = 512, whose merge is one CTA)
    for (w, k, n), want in {(16, 2048, 1024): True, (8, 2048, 2048): True, (8, 2048, 1024): True,
                            (16, 2048, 512): True, (8, 2048, 512): False, (16, 4096, 2048): False,
                            (8, 256, 64): False}.items():
        assert cache.has_wide_merge(w, k, n) == want, (w, k, n)
    assert merge.WIDE_KP == 4
    for (w, k, n), (c, kp) in {(16, 2048, 1024): (4, 8), (8, 2048, 1024): (4, 4), (8, 2048, 2048): (4, 8)}.items():
        m = cache._kernel_object("merge_wide", w, k, n)
        assert m.config == MergeConfig(w, k, n).wide() and (m.clus, m.kp1) == (c, kp), (w, k, n, m.clus, m.kp1)
    assert "merge_wide" not in cache.compile_images("sm_90a", 8, 2048, 512)


def test_lean_producer_image():
    """The lean producer image (kernels/lean.py): select_push's kernel and ABI with the lean
    select, for configurations whose rows are pushed in own parts (n <= 2048) without the rescue
    list; its split's slice_max / cache_max are the longest slice
    it takes (layout.PRODUCER_LEAN_SLICE_MAX), the launcher's rule layout.producer_uses_lean."""
    from jax_dsa_exchange.kernels import lean
    from jax_dsa_exchange.kernels.select_push import ProducerConfig, lean_ok, producer_configs

    assert lean.SLICE_MAX == lean.TB * lean.TMAX == layout.PRODUCER_LEAN_SLICE_MAX == 16384
    for (w, k, n, rl), want in {(8, 2048, 512, False): True, (16, 4096, 2048, False): True,
                                (16, 4096, 4096, False): False, (8, 2048, 512, True): False,
                                (8, 2048, 2048, True): True, (8, 256, 64, False): True}.items():
        assert lean_ok(n, k, rl) == want and cache.has_lean_producer(w, k, n, rl) == want, (w, k, n, rl)
        assert [c.lean for c in producer_configs(w, k, n, rl)] == [False, True][:1 + want], (w, k, n, rl)
    with pytest.raises(ValueError, match="no lean select_push for n=4096"):
        ProducerConfig(16, 4096, 4096, lean=True)
    imgs = cache.compile_images("sm_90a", 8, 2048, 512)
    assert list(imgs) == ["select_push", "select_push_lean", "merge"]
    sp, lp = imgs["select_push"][0], imgs["select_push_lean"][0]
    assert lp.kernel == "select_push" and lp.params == sp.params and lp.cubin != sp.cubin
    assert lp.split == dict(sp.split, slice_max=16384, cache_max=16384, cache_wide=16384,
                            min_slice=layout.PRODUCER_LEAN_MIN_SLICE, fill_ctas=layout.PRODUCER_LEAN_FILL_CTAS)
    # its shared memory with a full slice copy (the launch trims it as select_push's cache)
    assert lp.smem < sp.smem and 2 * lp.split["cache_max"] < lp.smem
    assert "select_push_lean" not in cache.compile_images("sm_90a", 8, 2048, 512, rescue_list=True)
    # the rule: slices cut from min(cols, 2**17) of at most slice_max tokens, an image at all
    for cols, c, want in ((8192, 1, True), (16384, 1, True), (16385, 1, False), (32768, 2, True),
                          (32768, 1, False), (131072, 8, True), (131072, 6, False), (200000, 8, True),
                          (0, 1, True), (20001, 2, True)):
        assert layout.producer_uses_lean(cols, c, 16384) == want, (cols, c)
        assert not layout.producer_uses_lean(cols, c, 0)
    # its rows cut finer (one CTA per 2048 tokens while the launch keeps within 64 CTAs), never
    # coarser than select_push's C; ranks sharing a GPU (cluster_max 1, fill_ctas 0) keep C
    for rows, cols, want in ((1, 8192, 4), (16, 8192, 4), (17, 8192, 3), (64, 8192, 1), (256, 8192, 1),
                             (1, 32768, 8), (16, 32768, 4), (64, 32768, 2), (1, 131072, 8), (2, 20001, 8),
                             (4, 3000, 2), (1, 1, 1)):
        c = layout.producer_cluster(rows, cols)
        assert layout.producer_uses_lean(cols, c, 16384)
        assert layout.producer_lean_cluster(rows, cols, c, lp.split) == want, (rows, cols, c)
        assert layout.producer_lean_cluster(rows, cols, c, dict(lp.split, cluster_max=1, fill_ctas=0)) == c


def test_producer_config_objects(tmp_path):
    """A producer image is its frozen ProducerConfig: producer_configs picks them (the lean one
    where lean_ok), SelectPush takes one and caches its compile on the object."""
    import dataclasses

    from jax_dsa_exchange.kernels.select_push import ProducerConfig, SelectPush, producer_configs

    cfg = ProducerConfig(2, 256, 64)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.lean = True
    assert producer_configs(2, 256, 64) == (cfg, ProducerConfig(2, 256, 64, lean=True))
    assert producer_configs(2, 4096, 4096) == (ProducerConfig(2, 4096, 4096),)
    assert cache.producer_images(2, 256, 64) == ("select_push", "select_push_lean")
    assert cache.producer_images(8, 2048, 512, rescue_list=True) == ("select_push",)
    obj = SelectPush(cfg)
    first = obj.compile("sm_90a", str(tmp_path))
    assert obj.compile("sm_90a", str(tmp_path)) is first


def test_kernel_signatures_are_the_abi():
    """The CuTe DSL kernel and entry spell out kernels/abi.py's parameters: same names,
    same order, annotated Int64 / Int32 as declared; the compile dummies follow it."""
    import inspect

    from cutlass import Int32, Int64

    from jax_dsa_exchange.kernels.merge import Merge
    from jax_dsa_exchange.kernels.select_push import SelectPush

    dsl = {"i64": Int64, "i32": Int32}
    ann = {"i64": "Int64", "i32": "Int32"}  # (string annotations: from __future__)
    for cls, k in ((SelectPush, abi.SELECT_PUSH), (Merge, abi.MERGE)):
        for fn in (cls.kernel, cls.entry):
            params = list(inspect.signature(fn).parameters.values())[1:]  # less self
            assert [p.name for p in params] == list(k.names), (cls.__name__, fn)
            assert [str(p.annotation) for p in params] == [ann[p.type] for p in k.params], (cls.__name__, fn)
        assert [type(d) for d in k.dummies(Int64, Int32)] == [dsl[p.type] for p in k.params]


def test_cache_key_follows_source(tmp_path):
    files = []
    for f in cache.SOURCE_FILES:
        p = tmp_path / f.name
        p.write_bytes(f.read_bytes())
        files.append(p)
    h0 = cache.source_hash(files)
    assert h0 == cache.source_hash()
    files[1].write_text(files[1].read_text() + "\n# edited\n")
    h1 = cache.source_hash(files)
    assert h1 != h0
    assert cache.config_tag("sm_90a", 8, 256, 64, h0) != cache.config_tag("sm_90a", 8, 256, 64, h1)


def test_source_hash_ignores_the_environment(monkeypatch):
    """The cubins' tag derives from the sources and the configuration alone: no environment
    variable changes kernel code."""
    h0 = cache.source_hash()
    monkeypatch.setenv("JAX_DSA_EXCHANGE_SELECT_TUNE", "u1=8")
    monkeypatch.setenv("JAX_DSA_EXCHANGE_MERGE_TUNE", "clus=4")
    assert cache.source_hash() == h0


def test_load_from_prebuilt_dir_and_clear_error(tmp_path, monkeypatch):
    w, k, n = CONFIGS[0]
    imgs = cache.compile_images("sm_90a", w, k, n)
    cache.write_images(imgs, tmp_path / "prebuilt")
    monkeypatch.setenv(cache.ENV_DIRS, str(tmp_path / "prebuilt"))
    monkeypatch.setenv(cache.ENV_CACHE, str(tmp_path / "usercache"))
    monkeypatch.setattr(cache, "_LOADED", {})
    got = cache.load_kernels("sm_90a", w, k, n, allow_compile=False)
    assert got["merge"].cubin == imgs["merge"][0].cubin
    assert got["select_push"].params == tuple(tuple(p) for p in imgs["select_push"][0].params)
    with pytest.raises(FileNotFoundError, match=r"jax_dsa_exchange\.build --arch sm_90a --topk 512"):
        cache.load_kernels("sm_90a", 2, 512, 64, allow_compile=False)
    # compiled on demand into the user cache, then found there
    monkeypatch.setattr(cache, "_LOADED", {})
    monkeypatch.setenv(cache.ENV_DIRS, "")
    cache.load_kernels("sm_90a", w, k, n)
    assert list((tmp_path / "usercache").glob("*/merge.json"))


def test_layout_constants_used_by_kernels():
    from jax_dsa_exchange.kernels import merge, select_push

    def mg(w, k, n):
        return merge.Merge(merge.MergeConfig(w, k, n))

    m = mg(16, 4096, 32)
    assert m.slots == layout.rescue_slots(4096, 32, 16) == 16 and m.keybits == 16 + layout.gid_bits(16)
    assert not mg(16, 4096, 2048).fast1 and mg(8, 2048, 512).fast1
    assert mg(16, 2048, 1024).fast1  # 32 words per thread
    assert merge.EQ_MAX == abi.MERGE_EQ_MAX and merge.CLUS_WIDE == abi.MERGE_CLUS_WIDE  # (tests/test_kernels_gpu.py)
    assert mg(8, 2048, 512).pre_bt and not mg(16, 2048, 1024).pre_bt
    assert mg(8, 2048, 512).fast2 and not mg(16, 2048, 1024).fast2
    # the producer's smem holds a slice cache of CACHE_MAX tokens, last; a launch with the
    # layout's cache_tokens needs 2 bytes less per token: two CTAs per SM fit with
    # cache_wide tokens (any grid), one with cache_max; the merge stays small
    from jax_dsa_exchange.kernels import select as S

    assert S.CACHE_MAX == layout.PRODUCER_CACHE_MAX and select_push.split()["cache_max"] == S.CACHE_MAX
    for n in (512, 4096):
        full = select_push.SelectPush(select_push.ProducerConfig(8, 4096, n)).smem
        assert full <= SMEM_OPT_IN_MAX
        assert full - 2 * (S.CACHE_MAX - layout.PRODUCER_CACHE_WIDE) <= SMEM_OPT_IN_MAX // 2
    # (the 16 KB pass-2 mask, a bit per token of a 2**17-token slice, included)
    assert select_push.SelectPush(select_push.ProducerConfig(8, 2048, 512)).smem - 2 * (S.CACHE_MAX - layout.PRODUCER_SLICE_MAX) <= 64 * 1024
    assert m.smem <= 64 * 1024


def test_select_push_beyond_the_own_part_push():
    """Rows of more than 2048 candidates (up to N = K = 4096) have more mask records than one
    warp's lanes: select_push keeps CTA 0's push there (own_part_ok), and still compiles."""
    from jax_dsa_exchange.kernels import select_push

    assert select_push.own_part_ok(2048) and not select_push.own_part_ok(2080)
    for n in (2080, 4096):
        layout.check_config(2, 4096, n)
        ptx = str(cache.compile_kernel("select_push", "sm_90a", 2, 4096, n)[1].__ptx__)
        assert "st.shared::cluster.u32" in ptx  # (into CTA 0's row)
        assert "barrier.cluster.arrive.release.aligned" in ptx


def _in_fresh_process(code: str, **env_vars):
    """Run ``code`` in a new Python process of this tree with the given environment variables
    (the kernels read their tune strings at import); -> CompletedProcess (text)."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root, **env_vars)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=600, cwd=root)  # fmt: skip


def test_lean_image_resources():
    """The lean image compiles without a stack frame and within 64 registers (two 512-thread
    CTAs per SM, which the R = 256 shapes rely on)."""
    img = cache.compile_images("sm_90a", 8, 2048, 512)["select_push_lean"][0]
    res = cache.cubin_resources(img.cubin)
    assert res["frame_bytes"] == 0 and res["registers"] <= 64, res


def test_select_push_cluster_protocol():
    """select_push's PTX at W = 2, N = 64 (rows over clusters, each CTA pushing its own part):
    cluster barriers 1 and 2 release only the CTA's own shared memory, the last is a relaxed
    arrival (its wait before exit), never a full release; the row comes from %clusterid.x; the
    mask walks load a thread's units by predicated u16 loads (two per 32-token word, three
    walks); the compaction's counts come from the second histogram's per-thread counters (two
    popc.b64 over their 2-bit fields)."""
    sp = cache.compile_images("sm_90a", 2, 256, 64)["select_push"][0].ptx
    assert sp.count("fence.release.sync_restrict::shared::cta.cluster") == 2
    assert sp.count("barrier.cluster.arrive.relaxed.aligned") == 3
    assert sp.count("barrier.cluster.arrive.release.aligned") == 0
    assert "%clusterid.x" in sp
    assert sp.count("@p ld.shared.u16") >= 6, sp.count("@p ld.shared.u16")
    assert sp.count("popc.b64") == 2


def test_clustered_merges_hold_round1_as_runs():
    """A clustered row's round 1 holds its keys as contiguous runs per thread (Merge.runs), a
    one-CTA row as pair groups (runs lost there).  The W = 16 N = 1024 merge (2 CTAs of 16 words
    a thread) and merge_wide (4 of 8) compile without a stack frame or a launch bound; W = 8
    N = 512 (one CTA) keeps the pair groups.  The layout's model: tests/test_merge_select_model.py."""
    imgs = cache.compile_images("sm_90a", 16, 2048, 1024)
    one = cache._kernel_object("merge", 8, 2048, 512)
    assert (one.clus, one.runs) == (1, False)
    for name, clus, kp in (("merge", 2, 16), ("merge_wide", 4, 8)):
        obj = cache._kernel_object(name, 16, 2048, 1024)
        img = imgs[name][0]
        assert (obj.clus, obj.kp1, obj.runs) == (clus, kp, True), (name, obj.clus, obj.kp1, obj.runs)
        assert cache.cubin_resources(img.cubin)["frame_bytes"] == 0, name
        assert ".minnctapersm" not in img.ptx, name


def test_rolled_round1_outputs_compile():
    """A one-CTA row of more than merge.ROLL_KP round-1 words per thread (W = 10, N = 1024: 20,
    not clustered) takes the rolled outputs loop (Merge.roll1) and pair groups (runs: clusters
    only), and compiles (a variable of the runs path named as the rolled loop's would be carried
    through that loop by the DSL: only a rolled configuration shows it)."""
    o = cache._kernel_object("merge", 10, 2048, 1024)
    img, _ = cache.compile_images("sm_90a", 10, 2048, 1024)["merge"]
    assert o.roll1 and o.clus == 1 and not o.runs and ".entry" in img.ptx


def test_rolled_round2_fits_beside_a_producer_cta():
    """Wherever the merge's round 2 is rolled over shared memory (Merge.roll2), the merge still
    fits on one SM beside a producer CTA (its CTAs start under PDL while the producer runs):
    both kernels' shared memory + the per-CTA reservation <= 228 KB.  Where it would not
    (W = 4, K = 4096, N = 2048), round 2 stays in registers; the measured configuration
    (W = 8, K = 2048, N = 512) is rolled."""
    from jax_dsa_exchange.kernels import merge, select_push

    rolled = set()
    for world in (1, 2, 3, 4, 8, 16):
        for topk, ns in ((256, (64, 128, 256)), (2048, (256, 512, 1024, 2048)), (4096, (2048, 4096))):
            for n in ns:
                m = merge.Merge(merge.MergeConfig(world, topk, n))
                if m.roll2:
                    rolled.add((world, topk, n))
                    assert (m.smem + select_push.smem_bytes(n, topk) + 2 * merge.CTA_RESERVED_SMEM
                            <= layout.ARCHS["sm_90a"].smem_per_sm), (world, topk, n, m.smem)  # fmt: skip
                    assert m.stage2_words % (2 * 512) == 0 and m.kp2 // 2 <= 16
    assert (8, 2048, 512) in rolled and (2, 2048, 512) in rolled
    assert (4, 4096, 2048) not in rolled and not merge.Merge(merge.MergeConfig(4, 4096, 2048)).roll2


def test_page_magic_is_exact_division():
    """merge.page_of's multiply equals l // B for every local index l < 2**17 (the argument
    in merge.py), for every B up to 4096 and a spread of larger ones."""
    import numpy as np

    from jax_dsa_exchange.kernels import merge

    ls = np.arange(layout.MAX_LOCAL_LEN, dtype=np.uint64)
    for b in list(range(1, 4097)) + [4099, 65535, 65536, 65537, 131071, 131072, 131073, 2**20, 2**31 - 1]:
        m = np.uint64(merge.page_magic(b))
        got = (ls * m) >> np.uint64(merge.PAGE_SHIFT)
        assert np.array_equal(got, ls // np.uint64(b)), b


def test_klist_state_region():
    """The K-list rows (the rescue list: the producer's local top-K for the merge's rescue) sit
    after the status words of the local state, 16-byte aligned, one packed row of K per row;
    ``words`` (what Exchange.read_state copies) does not include them."""
    for max_rows in (1, 3, 64, 257):
        st = layout.StateLayout(max_rows, 2048)
        assert st.klist_off % 4 == 0 and st.klist_off >= st.words
        assert st.klist_off == -(-(layout.STATE_STATUS_ROWS * max_rows + layout.STATUS_WORDS) // 4) * 4
        assert st.alloc_words == st.klist_off + max_rows * layout.row_words(2048)
        assert layout.StateLayout(max_rows).alloc_words == st.words


def test_rescue_list_kernels():
    """rescue_list=True (Exchange.create's option): at W = 8, N = 512 both kernels compile
    without a frame, differ from the default's, the merge's rescue loads the producer's
    K-list by .cg loads and drops its own select (less code), the producer's K-list words are
    staged in shared memory; where no rescue can happen (N = K) the cubins are the default's,
    byte for byte; the folders are tagged apart; the option is validated."""
    import hashlib

    def build(rl, w, k, n):
        out = {}
        for name in ("select_push", "merge"):
            compiled = cache.compile_kernel(name, "sm_90a", w, k, n, rl)[1]
            cub = bytes(compiled.__cubin__)
            out[name] = dict(cache.cubin_resources(cub), md5=hashlib.md5(cub).hexdigest(),
                             cg="ld.global.cg.v4" in str(compiled.__ptx__))  # fmt: skip
        return out

    base, rl = build(False, 8, 2048, 512), build(True, 8, 2048, 512)
    for name in ("select_push", "merge"):
        assert rl[name]["frame_bytes"] == 0 and rl[name]["md5"] != base[name]["md5"], (name, rl, base)
    assert rl["merge"]["cg"] and not base["merge"]["cg"]
    assert rl["merge"]["text_bytes"] < base["merge"]["text_bytes"]
    assert build(True, 1, 2048, 2048) == build(False, 1, 2048, 2048)
    h = cache.source_hash()
    assert cache.config_tag("sm_90a", 8, 2048, 512, h, True) != cache.config_tag("sm_90a", 8, 2048, 512, h)
    assert "--rescue-list" in cache.build_command("sm_90a", 8, 2048, 512, rescue_list=True)
    from jax_dsa_exchange import exchange

    with pytest.raises(TypeError, match="rescue_list"):
        exchange._check_create_args(2048, 512, 8, 8, 0, 1000, rescue_list=1)


@pytest.mark.parametrize("rescue_list", [False, True], ids=["default", "rescue-list"])
@pytest.mark.parametrize("arch", list(layout.ARCHS))
def test_default_configuration_builds_for_every_target(arch, rescue_list):
    """W = 8, K = 2048, N = 512 compiles for every target of layout.ARCHS (sm_100a / sm_103a:
    built and compile-tested only): each image names its target in its metadata, PTX and
    cubin, fits the target's shared memory per CTA, and has the launch ABI."""
    imgs = cache.compile_images(arch, 8, 2048, 512, rescue_list)
    lim = layout.ARCHS[arch]
    assert set(imgs) >= {"select_push", "merge"}
    for name, (img, _) in imgs.items():
        assert img.arch == arch and img.metadata()["arch"] == arch, name
        assert f".target {arch}" in img.ptx, name
        assert cache.cubin_sm(img.cubin) == 10 * lim.compute_capability[0] + lim.compute_capability[1], name
        assert 0 < img.smem <= lim.smem_per_cta, (name, img.smem)
        assert img.params == abi.KERNELS[img.kernel].pairs(), name
        assert cache.cubin_resources(img.cubin)["frame_bytes"] == 0, name


def test_targets_and_their_errors(tmp_path, monkeypatch):
    """layout.ARCHS names every target; another one is a ValueError naming them, at the build
    CLI too; a folder of another target's images is named in load_kernels' error."""
    assert layout.arch_of((9, 0)) == "sm_90a" and layout.arch_of((10, 3)) == "sm_103a"
    with pytest.raises(ValueError, match="arch='sm_80': the kernels build for sm_90a, sm_100a, sm_103a"):
        cache.check_build("sm_80", 8, 2048, 512)
    from jax_dsa_exchange import build

    with pytest.raises(SystemExit):
        build.main(["--arch", "sm_80", "--topk", "64", "--local-topk", "32", "--world", "1", "--out", str(tmp_path)])
    w, k, n = 1, 64, 32
    cache.write_images(cache.compile_images("sm_100a", w, k, n), tmp_path / "prebuilt")
    monkeypatch.setenv(cache.ENV_DIRS, str(tmp_path / "prebuilt"))
    monkeypatch.setenv(cache.ENV_CACHE, str(tmp_path / "empty"))
    monkeypatch.setattr(cache, "cutlass_available", lambda: False)
    assert cache.prebuilt_archs(w, k, n) == {"sm_100a"}
    with pytest.raises(FileNotFoundError, match=r"no prebuilt kernels for arch=sm_90a .*found for \['sm_100a'\] "
                                                r"only.*python -m jax_dsa_exchange.build --arch sm_90a"):
        cache.load_kernels("sm_90a", w, k, n, allow_compile=False)
