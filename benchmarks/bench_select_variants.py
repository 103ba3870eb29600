"""select_push build variants side by side, in ONE process on ONE GPU (W ranks simulated).

    JAX_DSA_EXCHANGE_CUBIN_DIR=.cubins PYTHONPATH=. python3 benchmarks/bench_select_variants.py \
        --variants default= norelax=relax=0 skip-pass2=skip=pass2 ...

Each variant is a ``JAX_DSA_EXCHANGE_SELECT_TUNE`` string (kernels/select.py: ``relax``, ``bulk``,
``cache``, ``u1``, ``early``; ``skip=`` builds are TIMING ONLY, their outputs
are wrong); its prebuilt cubin is found by the tag the string is mixed into
(kernels/cache.py), so no CuTe DSL is needed here.  One Sim (buffers, peers) is shared; only
rank 0's select_push runs (no merge), once per variant per measurement, the variants
interleaved, the whole list twice (the second round in reverse order) for the noise:

* probe (as ``bench_kernels.py --probe``): a CUDA graph of ``--reps`` launches back to back
  at R = 1, median of 5 replays, per launch: rows of 0 tokens, 8K and 128K, C = 1 and 8;
* bench rows: R x L = 1 x 8K, 1 x 128K, 64 x 128K, 256 x 128K with the launcher's C (and
  64 x 128K and 256 x 128K with C = 4: 32K-token slices, kept at any grid size),
  median CUDA-event time (a spacer memset first so no host gap is timed), 2 input sets.

``--dry-run`` (no GPU, no CuPy): resolve every variant's cubins and print their tags.
Ends with a table (us; mean of the two rounds; spread = largest |round1 - round2| / mean).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from jax_dsa_exchange import layout  # noqa: E402
from jax_dsa_exchange.kernels import cache  # noqa: E402

TUNE_ENV = "JAX_DSA_EXCHANGE_SELECT_TUNE"  # = kernels/select.TUNE_ENV (select.py needs the CuTe DSL)
PROBES = [(8192, 0, 1), (8192, 0, 8), (8192, 8192, 1), (8192, 8192, 8), (131072, 131072, 1),
          (131072, 131072, 8)]  # (L, row end, C)  # fmt: skip
ROWS = [(1, 8192, None), (1, 32768, None), (1, 131072, None), (16, 131072, None), (16, 131072, 8),
        (64, 32768, None), (64, 131072, None), (64, 131072, 4), (256, 32768, None), (256, 131072, None),
        (256, 131072, 4)]  # (R, L, C): None = the launcher's C
DEFAULT_VARIANTS = ["default=", "norelax=relax=0", "nobulk=bulk=0", "cache32k=cache=32768",
                    "skip-hist1=skip=hist1", "skip-pass2=skip=pass2", "skip-dsmem=skip=dsmem",
                    "skip-compact=skip=compact", "skip-push=skip=push",
                    "bare=skip=hist1+pass2+dsmem+compact+push", "floor=skip=select+push"]  # fmt: skip


def columns():
    return [f"p{L // 1024 if end else 0}kC{c}" for L, end, c in PROBES] + [
        f"R{R}L{L // 1024}k" + (f"C{c}" if c else "") for R, L, c in ROWS]  # fmt: skip


def read_tests(path):
    """{variant: status} from the run script's 'NAME STATUS ...' lines."""
    tests = {}
    if path and os.path.exists(path):
        for line in open(path):
            p = line.split()
            if len(p) >= 2:
                tests[p[0]] = p[1]
    return tests


def print_table(variants, info, cols, res, tests, W, K, N, reps, rounds):
    tunes = dict(variants)
    print(f"\nselect_push variants, W={W} K={K} N={N}; us per launch (p*: CUDA graph of {reps} "
          f"back to back, R=1, row of 0/8K/128K tokens, forced C; R*: CUDA events, policy C); mean "
          f"of {rounds} rounds; spread = max |r1-r2|/mean; skip-*/bare = TIMING ONLY (wrong outputs)")
    print(f"{'variant':<13} {'tests':<7} {'regs':>4} {'occ':>3} " + " ".join(f"{c:>{max(8, len(c))}}" for c in cols)
          + f" {'spread':>6}")  # fmt: skip
    for name, tune in variants:
        r = res[name]
        means = [statistics.mean(r[c]) for c in cols]
        spread = max([(max(r[c]) - min(r[c])) / m for c, m in zip(cols, means) if m == m and m] or [0])
        st = tests.get(name, "n/a" if "skip=" in tunes[name] else "-")
        i = info[name]
        print(f"{name:<13} {st:<7} {str(i['regs'])[:4]:>4} {str(i['ctas_per_sm'])[:3]:>3} "
              + " ".join(f"{m:{max(8, len(c))}.2f}" if m == m else f"{'-':>{max(8, len(c))}}"
                           for m, c in zip(means, cols)) + f" {100 * spread:5.1f}%")  # fmt: skip


def parse_variants(specs):
    """["name=TUNE", ...] -> [(name, tune)] (TUNE may contain '=' and ',')."""
    out = []
    for s in specs:
        name, _, tune = s.partition("=")
        out.append((name, tune))
    return out


def split_launch(tune):
    """TUNE -> (the cubin's tune string, launch smem floor in bytes).  ``lsmem=B`` (or
    ``lsmem=full``: the kernel's largest) is not a kernel knob: the same cubin launched with
    at least B bytes of shared memory, so fewer CTAs fit an SM (Sim.select_smem_floor)."""
    keep, floor = [], 0
    for kv in filter(None, tune.split(",")):
        k, _, v = kv.partition("=")
        if k == "lsmem":
            floor = 1 << 30 if v == "full" else int(v)
        else:
            keep.append(kv)
    return ",".join(keep), floor


def with_tune(tune, fn, *a, **k):
    old = os.environ.get(TUNE_ENV)
    if tune:
        os.environ[TUNE_ENV] = tune
    else:
        os.environ.pop(TUNE_ENV, None)
    try:
        return fn(*a, **k)
    finally:
        if old is None:
            os.environ.pop(TUNE_ENV, None)
        else:
            os.environ[TUNE_ENV] = old


def images_of(tune, arch, world, topk, n):
    return with_tune(split_launch(tune)[0], cache.load_kernels, arch, world, topk, n, allow_compile=False)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, help="NAME=TUNE ...")
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--n", type=int, default=512)
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--reps", type=int, default=20, help="launches per CUDA graph (probe)")
    ap.add_argument("--iters", type=int, default=20, help="timed launches per bench row")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--pattern", default="random", help="input scores: random | recent "
                    "(kernels.timing.PATTERNS)")
    ap.add_argument("--tests", default=None, help="file of 'NAME STATUS' lines (the exactness runs)")
    ap.add_argument("--json", default=None, help="write every number here")
    ap.add_argument("--dry-run", action="store_true", help="resolve the cubins only (no GPU)")
    ap.add_argument("--table", default=None, help="only print the table of this --json file "
                    "(with the --tests statuses)")
    a = ap.parse_args(argv)
    if a.table:
        with open(a.table) as f:
            j = json.load(f)
        print_table(list(j["variants"].items()), j["info"], j["cols"], j["results"],
                    read_tests(a.tests), j["W"], j["K"], j["N"], j["reps"], j["rounds"])
        return 0
    variants = parse_variants(a.variants)
    imgs = {}
    for name, tune in variants:
        imgs[name] = images_of(tune, a.arch, a.world, a.topk, a.n)["select_push"]
        print(f"variant {name!r} tune {tune!r}: source hash {imgs[name].source_hash[:16]}, "
              f"smem {imgs[name].smem}", flush=True)  # fmt: skip
    if a.dry_run:  # the table with made-up numbers (checks the printing, no GPU)
        cols = columns()
        fake = {nm: {c: [1.0 + i, 1.1 + i] for i, c in enumerate(cols)} for nm, _ in variants}
        info = {nm: dict(loaded="-", regs=64, local=0, ctas_per_sm=2) for nm, _ in variants}
        print_table(variants, info, cols, fake, read_tests(a.tests), a.world, a.topk, a.n, a.reps,
                    a.rounds)  # fmt: skip
        print(f"dry run: {len(variants)} variants resolved; probes {PROBES}; rows {ROWS}")
        return 0

    import cupy as cp

    from jax_dsa_exchange.kernels.timing import _events, pattern_scores
    from jax_dsa_exchange.testing.sim import Sim, _load_function

    W, K, N = a.world, a.topk, a.n
    sim = with_tune("", Sim, W, K, N, max(r for r, _, _ in ROWS))
    s0 = sim.streams[0]
    tmp = tempfile.TemporaryDirectory()
    fns, info, mods = {}, {}, []
    for i, (name, _) in enumerate(variants):
        d = os.path.join(tmp.name, str(i))
        os.makedirs(d)
        mod, fn, ext = _load_function(imgs[name], d)
        mods.append(mod)
        fns[name] = fn
        occ = None
        try:
            occ = cp.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(fn.ptr, 512, imgs[name].smem)
        except Exception as e:  # noqa: BLE001
            occ = f"? ({type(e).__name__})"
        info[name] = dict(loaded=ext, regs=getattr(fn, "num_regs", None),
                          local=getattr(fn, "local_size_bytes", None), ctas_per_sm=occ)  # fmt: skip
        print(f"{name}: {info[name]}", flush=True)
    base_images = dict(sim.images)

    def use(name):
        sim.images = dict(base_images, select_push=imgs[name])
        sim.fns["select_push"] = fns[name]
        sim.select_smem_floor = split_launch(dict(variants)[name])[1]

    def logits(R, L, nsets, seed):
        cp.random.seed(seed)
        out = []
        for _ in range(nsets):
            x = pattern_scores(cp, R, L, a.pattern)
            out.append(dict(logits=(x.view(cp.uint32) >> 16).astype(cp.uint16),
                            row_ends=cp.full((R,), L, cp.int32)))  # fmt: skip
            del x
        cp.cuda.Device().synchronize()  # (made on the current stream; the Sim's are non-blocking)
        return out

    spacer = cp.empty(256 << 20, cp.uint8)
    t = time.perf_counter()  # warm-up: keep the GPU busy ~0.5 s so the clocks ramp
    while time.perf_counter() - t < 0.5:
        for i in range(8):
            spacer.fill(i)
        cp.cuda.Device().synchronize()

    def probe(name, L, end, c, d):
        use(name)
        d["row_ends"].fill(end)
        for _ in range(3):
            sim.launch_rank(0, d, 1, L, 64, merge=False, cluster=c)
        s0.synchronize()
        s0.begin_capture()
        for _ in range(a.reps):
            sim.launch_rank(0, d, 1, L, 64, merge=False, cluster=c)
        g = s0.end_capture()
        ts = []
        for _ in range(5):
            e0, e1 = _events(cp)
            e0.record(s0)
            g.launch(s0)
            e1.record(s0)
            s0.synchronize()
            ts.append(cp.cuda.get_elapsed_time(e0, e1) * 1e3 / a.reps)
        return statistics.median(ts)

    def bench(name, R, L, c, sets):
        use(name)
        tm = []
        warm = 3
        for it in range(warm + a.iters):
            d = sets[it % len(sets)]
            e0, e1 = _events(cp)
            with s0:
                spacer.fill(it & 0xFF)  # keeps s0 busy while we enqueue
                e0.record(s0)
                sim.launch_rank(0, d, R, L, 64, merge=False, cluster=c)
                e1.record(s0)
            s0.synchronize()
            if it >= warm:
                tm.append(cp.cuda.get_elapsed_time(e0, e1) * 1e3)
        return statistics.median(tm)

    cols = columns()
    res = {name: {col: [] for col in cols} for name, _ in variants}
    order = [name for name, _ in variants]

    def save():  # after every column: a timed-out run still leaves its numbers (and --table)
        if a.json:
            done = {nm: {c: v for c, v in r.items() if v} for nm, r in res.items()}
            with open(a.json + ".tmp", "w") as f:
                json.dump(dict(variants=dict(variants), info=info,
                               cols=[c for c in cols if all(done[nm].get(c) for nm in done)],
                               results=done, probes=PROBES, rows=ROWS, W=W, K=K, N=N, reps=a.reps,
                               rounds=a.rounds), f, indent=1, default=str)  # fmt: skip
            os.replace(a.json + ".tmp", a.json)
    for rnd in range(a.rounds):
        names = order if rnd % 2 == 0 else order[::-1]
        for (L, end, c), col in zip(PROBES, cols):
            d = logits(1, L, 1, seed=1)[0]
            for name in names:
                res[name][col].append(probe(name, L, end, c, d))
            print(f"round {rnd} {col}: " + " ".join(f"{nm}={res[nm][col][-1]:.2f}" for nm in order),
                  flush=True)  # fmt: skip
            del d
            save()
        for (R, L, c), col in zip(ROWS, cols[len(PROBES):]):
            sets = logits(R, L, 2, seed=2)
            for name in names:
                res[name][col].append(bench(name, R, L, c, sets))
            print(f"round {rnd} {col} (C={c or sim.producer_cluster(R, L)}): "
                  + " ".join(f"{nm}={res[nm][col][-1]:.2f}" for nm in order), flush=True)  # fmt: skip
            del sets
            save()
    for q in range(W):
        st = sim.status(q)
        assert st[0] == 0, f"rank {q} status {st}"
    save()
    tests = read_tests(a.tests)
    print(f"\ninputs: {a.pattern} scores (kernels.timing.pattern_scores)")
    print_table(variants, info, cols, res, tests, W, K, N, a.reps, a.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
