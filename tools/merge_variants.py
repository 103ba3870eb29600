"""Merge-kernel variants (kernels/merge.py JAX_DSA_EXCHANGE_MERGE_TUNE): build, exactness
subset, timing, table.  Driven by tools/gpu_merge_variants.sh.

  CuTe DSL machine:  python tools/merge_variants.py --build [--jobs 2]
                     (-> build/merge_variants_cubins, packed into .cubins/merge_variants.tar.xz)
  GPU machine:       python3 tools/merge_variants.py --unpack /tmp/mv_cubins
                     python3 tools/merge_variants.py --tests --out-json DIR   (exact variants)
                     python3 tools/merge_variants.py --bench --out-json DIR   (every variant)
                     python3 tools/merge_variants.py --table --out-json DIR   (short table)
  no GPU (harness):  python tools/merge_variants.py --tests --dry-cpu ...     (fake Sim = model)

A variant is an env string; cache.source_hash() mixes it into the cubin tag, so every
variant's cubins sit in one JAX_DSA_EXCHANGE_CUBIN_DIR and the run selects them by setting
the env before a Sim loads its kernels (one process for all variants).  Timing-only variants
leave one stage out (their outputs are wrong): they are timed, never tested.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))
ENV = "JAX_DSA_EXCHANGE_MERGE_TUNE"


def _this_tree():
    """Import jax_dsa_exchange from ROOT: a venv with an editable install of another checkout
    puts a meta-path finder ahead of sys.path, which would build / test THAT checkout's
    kernels (with this tree's knobs).  Such finders are dropped; a package still found
    elsewhere is an error."""
    import importlib.util

    def origin():
        spec = importlib.util.find_spec("jax_dsa_exchange")
        return pathlib.Path(spec.origin).resolve() if spec and spec.origin else None

    o = origin()
    if o is not None and ROOT not in o.parents:
        sys.meta_path[:] = [f for f in sys.meta_path
                            if "editable" not in (type(f).__module__ or "").lower()]  # fmt: skip
        o = origin()
        if o is not None and ROOT not in o.parents:
            raise SystemExit(f"jax_dsa_exchange imports from {o}, not from {ROOT}")


_this_tree()

# (name, env string, kind): kind "exact" (tested + timed), "norm" (timing only, normal path:
# timed without rescue), "resc" (timing only, rescue path: timed with the forced rescue).
# The exact candidates of 2026-12-01 are gone from merge.py (flags, own2 adopted: the default;
# fused, eqwarp, peers, r2batch removed, see kernels/NOTES.md), and so are those of branch
# merge-fast3 (ostage, oball, tie1, tie2, fast3: within noise, removed; their code: commit
# 08ca710): a new one goes here as ("name", "knob=1", "exact") once merge.py has it.
VARIANTS = [
    ("default", "", "exact"),
    ("epijump", "epijump=1", "exact"),  # the layout before the eleventh session (row end after the rescue)
    ("tailout", "tailout=1", "exact"),  # the launch's end only after the row loop
    ("r2radix", "r2radix=1", "exact"),  # a rescue's round 2 by the radix walk (fewer registers)
    ("noload", "noload=1", "norm"),
    ("nobt", "nobt=1", "norm"),
    ("nosel", "nosel=1", "norm"),
    ("notie", "notie=1", "norm"),
    ("noout", "noout=1", "norm"),
    ("norescue", "norescue=1", "norm"),
    ("rnosel", "rnosel=1", "resc"),
    ("rnopush", "rnopush=1", "resc"),
    ("rnofence", "rnofence=1", "resc"),
    ("rnoflag", "rnoflag=1", "resc"),
    ("rnowait", "rnowait=1", "resc"),
    ("rnor2", "rnor2=1", "resc"),
]
WORLDS = [1, 2, 4, 8, 16]
TEST_CONFIGS = ([(w, 256, 64) for w in WORLDS] + [(w, 256, 256) for w in WORLDS]
                + [(8, 2048, 512), (2, 2048, 512), (16, 2048, 1024)])  # fmt: skip
BENCH_CONFIGS = [(8, 2048, 512), (16, 2048, 1024)]
LOCALK_CONFIG = (8, 2048, 2048)  # select+push with N = K: the rescue's local top-K + push
L = 8192
R8 = [1, 64, 256]
R16 = [64]


def configs_of(kind, name):
    c = list(BENCH_CONFIGS)
    if kind == "exact":
        c += [x for x in TEST_CONFIGS if x not in c]
    if name == "default":
        c.append(LOCALK_CONFIG)
    return c


# ------------------------------------------------------------------ build (CuTe DSL)


def build_one(out, cfgs):
    """In a process started with the variant's env: compile + write every config."""
    from jax_dsa_exchange.kernels import cache

    t0 = time.perf_counter()
    for w, k, n in cfgs:
        d = cache.write_images(cache.compile_images("sm_90a", w, k, n), out)
        print(f"  {os.environ.get(ENV, '') or 'default'} W={w} K={k} N={n}: {d.name}", flush=True)
    print(f"  {len(cfgs)} config(s) in {time.perf_counter() - t0:.1f}s", flush=True)


def build(out, jobs, archive, only=None):
    py = sys.executable
    procs, failed = [], []
    todo = [v for v in VARIANTS if only is None or v[0] in only]
    todo0 = list(todo)
    while todo or procs:
        while todo and len(procs) < jobs:
            name, env, kind = todo.pop(0)
            cfgs = configs_of(kind, name)
            arg = ";".join(f"{w},{k},{n}" for w, k, n in cfgs)
            e = dict(os.environ, PYTHONPATH=str(ROOT))
            e[ENV] = env
            # a cwd of its own: the CuTe DSL's --keep-ptx/--keep-cubin dump files there under the
            # kernel's name (the same for every variant and config) and cache.py reads the
            # cubin / PTX back from them, so two builds in one cwd can swap their images
            cwd = tempfile.mkdtemp(prefix=f"mv_build_{name}_")
            p = subprocess.Popen([py, __file__, "--build-one", arg, "--out", os.path.abspath(out)],
                                 env=e, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True)  # fmt: skip
            procs.append((name, p))
        for name, p in list(procs):
            if p.poll() is not None:
                log = p.stdout.read()
                print(f"[build {name}] rc={p.returncode}\n{log[-3000:] if p.returncode else log}",
                      flush=True)  # fmt: skip
                if p.returncode:
                    failed.append(name)
                procs.remove((name, p))
        time.sleep(0.2)
    print(f"build: {len(todo0) - len(failed)} variant(s) ok, failed: {failed}", flush=True)
    if failed:
        return 1
    pack(out, archive)
    return 0


def pack(out, archive):
    """All variants' folders (~80 MB, 2/3 of it PTX) -> one tar.xz (~10 MB) inside .cubins
    (the carry to the GPU machine is limited to 64 MiB)."""
    import tarfile

    t0 = time.perf_counter()
    archive = pathlib.Path(archive)
    archive.parent.mkdir(parents=True, exist_ok=True)
    tmp = archive.with_suffix(".tmp")
    with tarfile.open(tmp, "w:xz", preset=6) as tf:
        for d in sorted(pathlib.Path(out).iterdir()):
            if d.is_dir() and (d / "merge.json").is_file():
                tf.add(d, arcname=d.name)
    tmp.replace(archive)
    print(f"packed {out} -> {archive} ({archive.stat().st_size / 1e6:.1f} MB, "
          f"{time.perf_counter() - t0:.0f}s)", flush=True)  # fmt: skip


def unpack(archive, dest):
    import tarfile

    t0 = time.perf_counter()
    pathlib.Path(dest).mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "r:xz") as tf:
        tf.extractall(dest, filter="data")
    n = sum(1 for _ in pathlib.Path(dest).glob("*/merge.json"))
    print(f"unpacked {archive} -> {dest}: {n} config folders ({time.perf_counter() - t0:.1f}s)")


# ------------------------------------------------------------------ exactness subset


def _memo_reference():
    """reference.protocol_merge computed once per distinct input (the same cases recur for
    every variant): the CPU model is most of the test time."""
    import numpy as np

    from jax_dsa_exchange import reference

    orig = reference.protocol_merge
    if getattr(orig, "_memo", False):
        return
    memo = {}

    def feed(h, x):
        if isinstance(x, np.ndarray):
            h.update(str((x.dtype, x.shape)).encode())
            h.update(np.ascontiguousarray(x).tobytes())
        elif isinstance(x, (list, tuple)):
            h.update(b"[")
            for y in x:
                feed(h, y)
            h.update(b"]")
        elif isinstance(x, dict):
            for k in sorted(x):
                h.update(str(k).encode())
                feed(h, x[k])
        else:
            h.update(repr(x).encode())

    def protocol_merge(*args, **kw):
        h = hashlib.sha1()
        feed(h, args)
        feed(h, kw)
        key = h.hexdigest()
        if key not in memo:
            memo[key] = orig(*args, **kw)
        return memo[key]

    protocol_merge._memo = True
    reference.protocol_merge = protocol_merge


def test_list(T):
    """(id, callable) of the subset: every fast-path select branch, ties at the boundary,
    W in {1,2,4,8,16}, the production shapes, rescues (1..slots saturated ranks, a delayed
    rank, epochs cycling with rescues mixed in, a rescue that never comes)."""
    out = []
    for w in WORLDS:
        out.append((f"adversarial[{w}]", lambda w=w: T.test_adversarial(w)))
    for w in WORLDS:
        out.append((f"ties_boundary[{w}]", lambda w=w: T.test_ties_straddling_the_boundary_score(w)))
    out.append(("ties_boundary_large", T.test_ties_straddling_the_boundary_score_large))
    for w, k, n in [(8, 2048, 512), (16, 2048, 1024), (4, 256, 64)]:
        out.append((f"wide_range[{w}-{k}-{n}]", lambda w=w, k=k, n=n: T.test_wide_score_range(w, k, n)))
    for w, n in [(8, 512), (2, 512), (16, 1024)]:
        out.append((f"adversarial_large[{w}-{n}]", lambda w=w, n=n: T.test_adversarial_large(w, n)))
    for p in [(8, 2048, 512, 20000, 8), (16, 2048, 1024, 5000, 4), (2, 2048, 512, 1 << 17, 4)]:
        out.append((f"large_configs[{p[0]}-{p[2]}]", lambda p=p: T.test_large_configs(*p)))
    for w, k, n in [(8, 2048, 512), (2, 2048, 512), (4, 256, 64)]:
        out.append((f"rescue_tie_heavy[{w}-{k}-{n}]", lambda w=w, k=k, n=n: T.test_rescue_tie_heavy(w, k, n)))
    out.append(("consecutive_calls", T.test_consecutive_calls_cycle_epochs))
    out.append(("out_of_range_lookups", T.test_out_of_range_lookups_give_minus_one))
    out.append(("delayed_rank", T.test_delayed_rank))
    out.append(("missing_rescue_times_out", T.test_missing_rescue_times_out))
    return out


DRY_SKIP = ("delayed_rank", "missing_rescue_times_out", "consecutive_calls")


class _DrySim:
    """--dry-cpu: a Sim whose call() returns the reference outputs (checks the harness, the
    case generation and the reference cost without a GPU)."""

    def __init__(self, world, topk, n, max_rows=64, **kw):
        from jax_dsa_exchange.kernels import cache

        self.world, self.topk, self.n, self.max_rows = world, topk, n, max_rows
        self.tag = cache.config_tag("sm_90a", world, topk, n, cache.source_hash())

    def call(self, case, *, want_ids=True, want_sat=True, **kw):
        import numpy as np

        from jax_dsa_exchange import reference

        ref = reference.protocol_merge(*case.args, topk=case.topk, local_topk=case.local_topk,
                                       block_size=case.block_size)  # fmt: skip
        return [dict(kv_rows=r.kv_rows, counts=r.counts, ids=r.ids, saturated=r.saturated,
                     status=np.zeros(4, np.int32), host_status=np.zeros(4, np.int32))
                for r in ref]  # fmt: skip


def run_tests_isolated(out_json, names, dry, per_variant_s):
    """Each exact variant's tests in its own process (a kernel fault kills only that
    variant's CUDA context), under a timeout; results merged into tests.json."""
    for name, env, kind in VARIANTS:
        if kind != "exact" or (names and name not in names):
            continue
        cmd = [sys.executable, __file__, "--tests-one", "--variants", name, "--out-json", out_json]
        if dry:
            cmd.append("--dry-cpu")
        t0 = time.perf_counter()
        try:
            rc = subprocess.run(cmd, timeout=per_variant_s).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        res = _load(out_json, "tests.json")
        if name not in res or rc not in (0, 1):
            r = res.get(name, dict(env=env, tests=[]))
            r["tests"].append(["(process)", False, round(time.perf_counter() - t0, 1),
                               f"variant process ended with {rc}"])  # fmt: skip
            res[name] = r
            _save(out_json, "tests.json", res)
        print(f"[tests {name}] process rc={rc} in {time.perf_counter() - t0:.1f}s", flush=True)
    return _load(out_json, "tests.json")


def run_tests(out_json, names, dry, cubin_dirs):
    import test_kernels_gpu as T

    _memo_reference()
    if dry:
        T.sim_for = lambda world, topk, n, max_rows=64: _check_tag(_DrySim(world, topk, n, max_rows),
                                                                   cubin_dirs)  # fmt: skip
    res = _load(out_json, "tests.json")
    for name, env, kind in VARIANTS:
        if kind != "exact" or (names and name not in names):
            continue
        os.environ[ENV] = env
        T._SIMS.clear()
        rows = []
        t0 = time.perf_counter()
        res[name] = dict(env=env, tests=rows, secs=None)
        for tid, fn in test_list(T):
            if dry and tid in DRY_SKIP:
                continue
            t1 = time.perf_counter()
            try:
                fn()
                ok, err = True, ""
            except Exception as e:  # noqa: BLE001 - report and go on
                ok, err = False, f"{type(e).__name__}: {str(e)[:400]}"
                traceback.print_exc(limit=3)
            rows.append([tid, ok, round(time.perf_counter() - t1, 2), err])
            print(f"[tests {name}] {tid}: {'ok' if ok else 'FAIL ' + err} "
                  f"({rows[-1][2]:.1f}s)", flush=True)  # fmt: skip
            _save(out_json, "tests.json", res)  # partial results survive a crash / timeout
        T._SIMS.clear()
        res[name] = dict(env=env, tests=rows, secs=round(time.perf_counter() - t0, 1))
        _save(out_json, "tests.json", res)
        _free()
    os.environ.pop(ENV, None)
    return res


def _check_tag(sim, cubin_dirs):
    """--dry-cpu: the variant's cubins must be in the cubin dir (what the GPU run loads)."""
    for d in cubin_dirs:
        if (pathlib.Path(d) / sim.tag / "merge.json").is_file():
            return sim
    raise FileNotFoundError(f"no cubins {sim.tag} in {cubin_dirs}")


# ------------------------------------------------------------------ timing


def _free():
    try:
        import cupy as cp

        cp.get_default_memory_pool().free_all_blocks()
    except Exception:  # noqa: BLE001
        pass


def run_bench(out_json, names, iters):
    import cupy as cp
    from bench_kernels import time_merge

    from jax_dsa_exchange.kernels.timing import KernelTimer

    res = _load(out_json, "bench.json")
    # warm-up: the GPU busy ~0.5 s before timing (clocks ramp)
    x = cp.empty(256 << 20, cp.uint8)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 0.5:
        x.fill(1)
        cp.cuda.Device().synchronize()
    del x
    plan = [(n, e, k) for n, e, k in VARIANTS if not names or n in names]
    # default, then the breakdown (timing-only), then the candidates, default again last
    # (drift over the run shows as noise); a timeout loses the candidates first
    plan = ([v for v in plan if v[0] == "default"] + [v for v in plan if v[2] != "exact"]
            + [v for v in plan if v[2] == "exact" and v[0] != "default"])  # fmt: skip
    if plan and plan[0][0] == "default":
        plan.append(("default#2", "", "exact"))
    for name, env, kind in plan:
        if name in res:  # --bench again after a crash: done (or the one that crashed)
            if res[name].get("started") and "done" not in res[name]:
                res[name]["error"] = "the bench process died in this variant"
                _save(out_json, "bench.json", res)
            continue
        os.environ[ENV] = env
        r = {"env": env, "started": 1}
        res[name] = r
        _save(out_json, "bench.json", res)
        try:
            for (w, k, n), Rs in (((8, 2048, 512), R8), ((16, 2048, 1024), R16)):
                b = KernelTimer(cp, w, k, n, max(Rs))
                if name == "default":
                    r[f"floor_w{w}"] = round(time_merge(b, 0, L, False, iters=iters), 2)
                for R in Rs:
                    if kind != "resc":
                        r[f"w{w}_r{R}"] = round(time_merge(b, R, L, False, iters=iters), 2)
                    if kind != "norm" and w == 8:
                        r[f"w{w}_r{R}_resc"] = round(time_merge(b, R, L, True, iters=6, warm=2), 2)
                        r[f"w{w}_r{R}_satrows"] = b.last_sat_rows
                    print(f"[bench {name}] W={w} R={R}: {r.get(f'w{w}_r{R}')} us, rescue "
                          f"{r.get(f'w{w}_r{R}_resc')} us", flush=True)  # fmt: skip
                del b
                _free()
        except Exception as e:  # noqa: BLE001
            r["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            traceback.print_exc(limit=3)
            if type(e).__name__ in ("CUDARuntimeError", "CUDADriverError"):
                # the CUDA context may be dead: the shell restarts --bench, which skips this one
                r["done"] = 1
                _save(out_json, "bench.json", res)
                os._exit(3)
        r["done"] = 1
        res[name] = r
        _save(out_json, "bench.json", res)
    os.environ.pop(ENV, None)
    if "localK" not in res and (not names or "default" in names):
        try:
            bk = KernelTimer(cp, *LOCALK_CONFIG, max(R8))
            lk = {}
            for R in R8:
                lk[str(R)] = round(bk.run(R, L, rescue=False, iters=6, warm=2)[0], 2)
            res["localK"] = lk
            print(f"[bench] local top-K (select+push N=K): {lk}", flush=True)
            del bk
        except Exception as e:  # noqa: BLE001
            res["localK"] = {"error": str(e)[:300]}
        _save(out_json, "bench.json", res)
    return res


# ------------------------------------------------------------------ table


def table(out_json):
    tests = _load(out_json, "tests.json")
    bench = _load(out_json, "bench.json")
    cols = [f"w8_r{R}" for R in R8] + [f"w8_r{R}_resc" for R in R8] + [f"w16_r{R}" for R in R16]
    heads = [f"W8R{R}" for R in R8] + [f"W8R{R}+res" for R in R8] + [f"W16R{R}" for R in R16]
    base = {}
    for c in cols:
        v = [bench[n][c] for n in ("default", "default#2") if c in bench.get(n, {})]
        base[c] = statistics.mean(v) if v else None
    f = lambda x: "-" if x is None else f"{x:7.2f}"  # noqa: E731
    lines = ["", f"merge variants (us, median CUDA events, rank 0's merge alone; L={L}, K=2048; "
             f"W8 = W=8 N=512, W16 = W=16 N=1024; +res = forced rescue of rank 0; "
             f"d = variant - mean(default, default#2))",  # fmt: skip
             f"floor (R=0) W8 {bench.get('default', {}).get('floor_w8')} W16 "
             f"{bench.get('default', {}).get('floor_w16')}; local top-K (select+push N=K) "
             f"{bench.get('localK')}",  # fmt: skip
             f"{'variant':<14} {'tests':>7} | " + " ".join(f"{h:>9}" for h in heads)]
    for name, env, kind in [("default#2", "", "exact")] + VARIANTS:
        if name == "default#2":
            continue
        for nm in ([name, "default#2"] if name == "default" else [name]):
            r = bench.get(nm, {})
            t = tests.get(nm)
            ts = "-" if t is None else f"{sum(x[1] for x in t['tests'])}/{len(t['tests'])}"
            if kind != "exact":
                ts = "timing"
            lines.append(f"{nm:<14} {ts:>7} | " + " ".join(f"{f(r.get(c)):>9}" for c in cols)
                         + (f"  ERR {r['error'][:60]}" if "error" in r else ""))  # fmt: skip
            if nm not in ("default", "default#2"):
                d = [None if r.get(c) is None or base[c] is None else r[c] - base[c] for c in cols]
                lines.append(f"{'  d':<14} {'':>7} | " + " ".join(
                    f"{'-' if x is None else f'{x:+7.2f}':>9}" for x in d))  # fmt: skip
    bad = [(n, x[0], x[3][:120]) for n, t in tests.items() for x in t["tests"] if not x[1]]
    if bad:
        lines.append("FAILED tests: " + "; ".join(f"{n}:{i} {e}" for n, i, e in bad[:8]))
    print("\n".join(lines))


def _load(d, f):
    p = pathlib.Path(d) / f
    return json.loads(p.read_text()) if p.is_file() else {}


def _save(d, f, obj):
    p = pathlib.Path(d)
    p.mkdir(parents=True, exist_ok=True)
    (p / f).write_text(json.dumps(obj, indent=1))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", action="store_true")
    ap.add_argument("--build-one", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(ROOT / "build" / "merge_variants_cubins"),
                    help="folder the variants are built into (loose)")
    ap.add_argument("--archive", default=str(ROOT / ".cubins" / "merge_variants.tar.xz"),
                    help="--build packs --out into this; --unpack extracts it")
    ap.add_argument("--pack", action="store_true", help="only pack --out into --archive")
    ap.add_argument("--unpack", default=None, metavar="DEST", help="extract --archive into DEST")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--tests", action="store_true", help="exact variants' tests, a process each")
    ap.add_argument("--tests-one", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--per-variant-s", type=float, default=45)
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--table", action="store_true")
    ap.add_argument("--dry-cpu", action="store_true", help="tests against a fake Sim (no GPU)")
    ap.add_argument("--variants", nargs="*", default=None)
    ap.add_argument("--iters", type=int, default=12)
    ap.add_argument("--out-json", default=os.environ.get("OUT", "/tmp/merge_variants"))
    a = ap.parse_args(argv)
    if a.build_one is not None:
        build_one(a.out, [tuple(int(x) for x in c.split(",")) for c in a.build_one.split(";")])
        return 0
    if a.build:
        return build(a.out, a.jobs, a.archive, a.variants)
    if a.pack:
        pack(a.out, a.archive)
        return 0
    if a.unpack:
        unpack(a.archive, a.unpack)
        return 0
    rc = 0
    if a.tests_one:
        dirs = [p for p in os.environ.get("JAX_DSA_EXCHANGE_CUBIN_DIR", "").split(os.pathsep) if p]
        res = run_tests(a.out_json, a.variants, a.dry_cpu, dirs)
        return int(any(not x[1] for t in res.values() for x in t["tests"]))
    if a.tests:
        res = run_tests_isolated(a.out_json, a.variants, a.dry_cpu, a.per_variant_s)
        rc |= int(any(not x[1] for t in res.values() for x in t["tests"]))
    if a.bench:
        run_bench(a.out_json, a.variants, a.iters)
    if a.table:
        table(a.out_json)
    return rc


if __name__ == "__main__":
    sys.exit(main())
