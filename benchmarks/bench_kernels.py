"""Raw-kernel benchmark on ONE GPU: W ranks simulated in one process (CuPy).

    JAX_DSA_EXCHANGE_CUBIN_DIR=.cubins PYTHONPATH=. python3 benchmarks/bench_kernels.py

For K = 2048, W = 8, N in {256, 512, 1024}, R in {1, 16, 64, 256}, L in {8K,
32K, 128K}: median device time (CUDA events; the stream is kept busy by a
spacer memset before the first event so host launch gaps are not timed;
warm-up; inputs rotate over several sets) of

* select+push of rank 0 (grid = R CTAs): local top-N of R x L bf16 + LL push
  of the rows to the 8 ranks' buffers;
* merge of rank 0 alone (grid = min(R, 132)), data already pushed: without
  rescue (random logits) and with a forced rescue (rank 0's scores + 100, so
  rank 0 is saturated on every row and also computes its local top-K of L);

(``--pair``: rank 0's producer and merge back to back on one stream, the merge under PDL as
the C++ launcher launches it and in plain stream order, next to each alone: what the merge
adds to a decode step) next to a device copy bandwidth and jax.lax.top_k baselines measured in the
same run on [R, L] (what select+push replaces) and on [R, W*N] (the merge's
round 1), each as device time of 16 dependent calls in one jitted loop.  Ends with a table; "read" = one read of R x L bf16 at the
measured copy bandwidth (bytes / (read + write rate of a copy)).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np


os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from jax_dsa_exchange import layout  # noqa: E402
from jax_dsa_exchange.baselines import jax_topk_time, topk64_times, torch_topk_time  # noqa: E402
from jax_dsa_exchange.kernels.timing import KernelClock, KernelTimer as Bench, _events, copy_bandwidth, firsts_of_groups  # noqa: E402,E501


def time_merge(b, R, L, rescue, iters=12, warm=3, seed=0):
    """Median device time (CUDA events) of rank 0's merge ALONE on the GPU, data
    already pushed: every producer first, then rank 0's merge (grid min(R, 64)), then
    the other ranks' merges after it (so they do not take SMs from it; with the forced
    rescue only rank 0 is saturated, so its merge waits for no other rank).  R = 0
    times an empty launch of the merge (the launch and event floor).  Also sets
    ``b.last_kernel_us``: the median of the merge kernel's own duration (CUPTI, KernelClock;
    nan without PyTorch)."""
    cp, sim, W = b.cp, b.sim, b.world
    clock = KernelClock()
    Rd = max(R, 1)
    nsets = 2 if Rd * L * W * 2 > (1 << 29) else 4
    sets = b.inputs(Rd, L, nsets, rescue, seed)
    s0 = sim.streams[0]
    tm = []
    for it in range(warm + iters):
        d = sets[it % nsets]
        if it == warm:
            clock.__enter__()
        if R:
            for q in range(W):
                sim.launch_rank(q, d[q], R, L, 64, merge=False)
        cp.cuda.Device().synchronize()
        e0, e1 = _events(cp)
        with s0:
            b.spacer.fill(it & 0xFF)  # keeps s0 busy while we enqueue
            e0.record(s0)
            sim.launch_rank(0, d[0], R, L, 64, producer=False, grid=max(1, min(R, 64)))
            e1.record(s0)
        s0.synchronize()
        if R:
            for q in range(1, W):
                sim.launch_rank(q, d[q], R, L, 64, producer=False, grid=min(R, 8))
        cp.cuda.Device().synchronize()
        if it >= warm:
            tm.append(cp.cuda.get_elapsed_time(e0, e1) * 1e3)
    clock.__exit__(None, None, None)
    # rank 0's merge ran (and was waited for) before the other ranks' merges of its iteration
    ks = firsts_of_groups(clock.starts_and_durations("kernelsmerge"), W if R else 1)
    b.last_kernel_us = statistics.median(ks) if len(ks) == iters else float("nan")
    for q in range(W):
        st = sim.status(q)
        assert st[0] == 0, f"rank {q} status {st}"
    b.last_sat_rows = float((sets[0][0]["sat"].get()[:Rd] != 0).mean()) if R else 0.0
    del sets
    return statistics.median(tm)


def merge_only(cp, a):
    """Merge alone (data already pushed) against top-k of 64-bit keys [R, W*N], and the
    forced rescue against the producer's local top-K of the same rows (select+push built
    with N = K: local top-K of each row + its push, on rank 0's rows of the forced rescue:
    logits + 100, which in bf16 puts its top 2048 of 8192 into about a dozen codes)."""
    L = a.cols[0]
    res = []
    for n in a.n:
        if a.world * n <= a.topk:
            # every row then needs a rescue, and rank 0's merge runs alone first here: it would
            # wait for its peers' rescue flags until the timeout (the full bench times such rows)
            print(f"N={n}: skipped (W*N = {a.world * n} <= K = {a.topk}: every row is rescued; "
                  f"the merge alone is timed only without a rescue)", flush=True)
            continue
        b = Bench(cp, a.world, a.topk, n, max(a.rows), pattern=a.pattern, spacer_mb=a.spacer_mb)
        print(f"N={n} (inputs: {a.pattern}): loaded {b.sim.loaded_from}", flush=True)
        t0 = time.perf_counter()  # warm-up: the GPU busy for ~0.5 s before timing (clocks ramp)
        while time.perf_counter() - t0 < 0.5:
            for i in range(8):
                b.spacer.fill(i)
            cp.cuda.Device().synchronize()
        floor = time_merge(b, 0, L, False, iters=a.iters)
        kfloor = b.last_kernel_us
        print(f"merge launch floor (R=0, empty launch): {floor:.2f}us (kernel {kfloor:.2f}us)", flush=True)
        for R in a.rows:
            tm = time_merge(b, R, L, False, iters=a.iters)
            km = b.last_kernel_us
            tr = kr = float("nan")
            sat = float("nan")
            if not a.no_rescue:
                tr = time_merge(b, R, L, True, iters=6, warm=2)
                kr = b.last_kernel_us
                sat = b.last_sat_rows
            tk = {"jax": None, "torch": None} if a.no_jax else topk64_times(R, a.world * n, a.topk)
            res.append([n, R, tm, tr, sat, tk["jax"], tk["torch"], None, floor, kfloor, km, kr])
            print(f"merge W={a.world} N={n} R={R} L={L}: {tm:.2f}us (kernel {km:.2f}us), forced rescue "
                  f"{tr:.2f}us (kernel {kr:.2f}us, rescued rows {sat}), top-k int64 [R,W*N] jax {tk['jax']} "
                  f"torch {tk['torch']}", flush=True)  # fmt: skip
        del b
    if not a.no_rescue:
        try:
            bk = Bench(cp, a.world, a.topk, a.topk, max(a.rows), spacer_mb=a.spacer_mb)
            for r in res:
                # the local top-K of the same rows the forced rescue selects from (rank 0's
                # logits + 100, as in time_merge): issue #12 compares the rescue with it
                tp, _ = bk.run(r[1], L, rescue=True, iters=6, warm=2, merge=False)
                r[7] = tp
            del bk
        except FileNotFoundError as e:
            print(f"no N=K build for the local top-K time: {e}", flush=True)
    f = lambda v: "-" if v is None or v != v else f"{v:8.2f}"  # noqa: E731
    print(f"\nmerge alone, W={a.world} K={a.topk} L={L}; us, median (CUDA events / graph replay; "
          f"'kernel' = the kernel's own duration, CUPTI); localK = select+push with N=K (the rescue's "
          f"local top-K + push)")
    print(f"{'N':>5} {'R':>4} | {'floor':>8} {'merge':>8} {'kernel':>8} | {'+rescue':>8} {'kernel':>8} "
          f"{'localK':>8} {'resc-lK':>8} | {'jax tk64':>8} {'torch tk64':>10}")  # fmt: skip
    for n, R, tm, tr, sat, tj, tt, tk, fl, kfl, km, kr in res:
        d = None if tk is None or tr != tr else tr - tk
        print(f"{n:>5} {R:>4} | {f(fl)} {f(tm)} {f(km)} | {f(tr)} {f(kr)} {f(tk)} {f(d)} | {f(tj)} "
              f"{f(tt):>10}")
    return res


def pair_times(cp, a):
    """The decode step's pair on rank 0 (producer then merge on one stream, the other ranks'
    rows already pushed), with the merge under PDL (as the C++ launcher launches it) and in
    plain stream order, next to the producer and the merge each timed alone in the same
    run: what the merge adds to a step is the pair minus the producer alone."""
    res = []
    for n in a.n:
        b = Bench(cp, a.world, a.topk, n, max(a.rows), pattern=a.pattern, spacer_mb=a.spacer_mb)
        print(f"N={n}: loaded {b.sim.loaded_from}", flush=True)
        for R in a.rows:
            for L in a.cols:
                tp, _ = b.run(R, L, rescue=False, iters=a.iters, warm=3, merge=False)
                kp = b.last_producer_kernel_us
                tm = time_merge(b, R, L, False, iters=a.iters)
                km = b.last_kernel_us
                t_pdl = b.pair(R, L, True, iters=a.iters)
                s_pdl, ov = b.last_pair_span_us, b.last_pair_overlap_us
                t_seq = b.pair(R, L, False, iters=a.iters)
                s_seq = b.last_pair_span_us
                res.append((n, R, L, tp, kp, tm, km, t_seq, s_seq, t_pdl, s_pdl, ov))
                print(f"pair N={n} R={R} L={L}: producer {tp:.2f} (kernel {kp:.2f}) merge {tm:.2f} (kernel "
                      f"{km:.2f}) pair plain {t_seq:.2f} (span {s_seq:.2f}) pair PDL {t_pdl:.2f} (span "
                      f"{s_pdl:.2f}, merge started {ov:.2f} us before the producer ended)", flush=True)  # fmt: skip
        del b
    print(f"\nthe pair on rank 0, W={a.world} K={a.topk}; us, median; events = CUDA events around the "
          f"launches (after a busy stream), span = CUPTI from the producer's start to the merge's end; "
          f"'+merge' = pair (PDL) - producer alone, events and span - producer kernel")  # fmt: skip
    print(f"{'N':>5} {'R':>4} {'L':>7} | {'prod':>6} {'kern':>6} | {'merge':>6} {'kern':>6} | {'plain':>6} "
          f"{'span':>6} | {'PDL':>6} {'span':>6} | {'+merge':>6} {'+span':>6}")  # fmt: skip
    for n, R, L, tp, kp, tm, km, t_seq, s_seq, t_pdl, s_pdl, ov in res:
        print(f"{n:>5} {R:>4} {L:>7} | {tp:6.2f} {kp:6.2f} | {tm:6.2f} {km:6.2f} | {t_seq:6.2f} {s_seq:6.2f} | "
              f"{t_pdl:6.2f} {s_pdl:6.2f} | {t_pdl - tp:6.2f} {s_pdl - kp:6.2f}")  # fmt: skip
    return res


def probe(cp, world, topk, n, reps=20):
    """select_push per launch when launched back to back (a CUDA graph of reps
    launches, median of 5 replays; no other kernel in between) at R = 1: empty rows (the fixed
    cost), then growing rows, per cluster size."""
    b = Bench(cp, world, topk, n, 8)
    sim = b.sim
    s0 = sim.streams[0]
    for L in (8192, 131072):
        d = b.inputs(1, L, 1, False, seed=1)[0][0]
        for end in (0, 1024, L):
            d["row_ends"].fill(end)
            for c in (1, 2, 4, 8):
                for _ in range(3):
                    sim.launch_rank(0, d, 1, L, 64, merge=False, cluster=c)
                s0.synchronize()
                s0.begin_capture()  # a CUDA graph of reps launches: no host gaps
                for _ in range(reps):
                    sim.launch_rank(0, d, 1, L, 64, merge=False, cluster=c)
                g = s0.end_capture()
                ts = []
                clock = KernelClock()
                with clock:
                    for _ in range(5):
                        e0, e1 = _events(cp)
                        e0.record(s0)
                        g.launch(s0)
                        e1.record(s0)
                        s0.synchronize()
                        ts.append(cp.cuda.get_elapsed_time(e0, e1) * 1e3 / reps)
                t = statistics.median(ts)
                ks = [d for _, d in clock.starts_and_durations("kernelsselect_push")]
                k = statistics.median(ks) if ks else float("nan")
                print(f"probe N={n} R=1 L={L} end={end} C={c}: {t:.2f}us per launch (back to back), "
                      f"kernel {k:.2f}us (CUPTI)", flush=True)  # fmt: skip
    del b


def cluster_sweep(cp, world, topk, n, rows, cols, clusters, iters):
    """select_push time per forced cluster size (the policy's choice on this device marked)."""
    b = Bench(cp, world, topk, n, max(rows))
    out = []
    for R in rows:
        for L in cols:
            for c in clusters:
                tp, _ = b.run(R, L, rescue=False, iters=iters, warm=2, cluster=c, merge=False)
                pol = b.sim.producer_launch(R, L)[1]
                out.append((n, R, L, c, tp, c == pol))
                print(f"sweep N={n} R={R} L={L} C={c}{' (policy)' if c == pol else ''}: "
                      f"select+push {tp:.1f}us", flush=True)  # fmt: skip
    del b
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--n", type=int, nargs="+", default=[256, 512, 1024])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--cols", type=int, nargs="+", default=[8192, 32768, 131072])
    ap.add_argument("--no-jax", action="store_true")
    ap.add_argument("--iters", type=int, default=12)
    ap.add_argument("--clusters", type=int, nargs="*", default=None,
                    help="also time select_push with each forced cluster size (CTAs per row)")
    ap.add_argument("--only-sweep", action="store_true", help="only the cluster sweep")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--probe", action="store_true", help="back-to-back select_push launches at R=1")
    ap.add_argument("--no-rescue", action="store_true")
    ap.add_argument("--diag", action="store_true", help="producer/merge time vs R, kernel attributes")
    ap.add_argument("--pattern", default="random", help="input scores: random | recent (kernels.timing.PATTERNS)")
    ap.add_argument("--merge-only", action="store_true",
                    help="merge alone vs top-k of 64-bit keys (torch, jax); rescue vs local top-K")
    ap.add_argument("--pair", action="store_true",
                    help="rank 0's producer + merge on one stream, merge under PDL and not, vs each alone")
    ap.add_argument("--spacer-mb", type=int, default=256,
                    help="the memset before each timed launch (MB): 256 leaves the L2 cold; 1 keeps it warm")
    a = ap.parse_args(argv)
    import cupy as cp

    if a.probe:
        probe(cp, a.world, a.topk, a.n[0])
    sweep = []
    if a.clusters:
        for n in a.n:
            sweep += cluster_sweep(cp, a.world, a.topk, n, a.rows, a.cols, a.clusters, a.iters)
        print("\nselect_push by cluster size (us):")
        for n, R, L, c, tp, pol in sweep:
            print(f"  N={n:>5} R={R:>4} L={L:>7} C={c} {tp:8.1f}{'  <- policy' if pol else ''}")
        if a.only_sweep:
            return

    if a.merge_only:
        merge_only(cp, a)
        return
    if a.pair:
        pair_times(cp, a)
        return
    bw = copy_bandwidth(cp)
    print(f"device copy bandwidth: {bw / 1e12:.2f} TB/s (read + write)", flush=True)
    rows = []
    jax_cache = {}
    if a.diag:
        b = Bench(cp, a.world, a.topk, 512, 256)
        for name, fn in b.sim.fns.items():
            attrs = {k: getattr(fn, k, None) for k in ("num_regs", "local_size_bytes",
                     "shared_size_bytes", "max_threads_per_block")}  # fmt: skip
            print(f"{name}: {attrs}", flush=True)
        for R in (1, 8, 16, 32, 64, 128, 132, 256):
            tp, tm = b.run(R, 32768, rescue=False, iters=6, warm=2)
            print(f"diag N=512 L=32768 R={R}: select+push {tp:.1f}us merge {tm:.1f}us", flush=True)
        del b
    from jax_dsa_exchange import layout

    base_cache = {}

    def baseline(kind, shape, k, dtype):
        key = (kind, shape, k, dtype)
        if key not in base_cache:
            if kind == "jax":
                t = None if a.no_jax else jax_topk_time(shape, k)
            else:
                t = None if a.no_torch else torch_topk_time(shape, k, dtype)
            base_cache[key] = None if t is None else t * 1e6
        return base_cache[key]

    for n in a.n:
        b = Bench(cp, a.world, a.topk, n, max(a.rows), pattern=a.pattern, spacer_mb=a.spacer_mb)
        print(f"N={n} (inputs: {a.pattern}): loaded {b.sim.loaded_from}, smem {[i.smem for i in b.sim.images.values()]}",
              flush=True)  # fmt: skip
        for R in a.rows:
            for L in a.cols:
                tp, tm = b.run(R, L, rescue=False, iters=a.iters, warm=min(3, a.iters))
                kp = b.last_producer_kernel_us
                sat0 = b.last_sat_rows
                tr, sat1 = float("nan"), float("nan")
                if not a.no_rescue:
                    _, tr = b.run(R, L, rescue=True, iters=6, warm=2)
                    sat1 = b.last_sat_rows
                # memory floor of select_push: one read of the logits or one write of the
                # LL rows it pushes to the W ranks, at the copy bandwidth (read + write)
                read_us = R * L * 2 / bw * 1e6
                push_us = R * a.world * layout.ll_row_bytes(n) / bw * 1e6
                floor = max(read_us, push_us)
                goal = max(6.0, 3 * floor)
                jl = baseline("jax", (R, L), n, "bfloat16")
                tl = baseline("torch", (R, L), n, "bfloat16")
                key64 = ("k64", R, a.world * n)
                if key64 not in base_cache:
                    base_cache[key64] = ({"jax": None, "torch": None} if a.no_jax and a.no_torch
                                         else topk64_times(R, a.world * n, a.topk))  # fmt: skip
                jm, tmk = base_cache[key64]["jax"], base_cache[key64]["torch"]
                rows.append((n, R, L, tp, floor, goal, tl, jl, tm, tr, tmk, jm, sat0, sat1,
                             b.sim.producer_launch(R, L)[1], kp))  # fmt: skip
                print(f"N={n} R={R} L={L}: select+push {tp:.1f}us (kernel {kp:.1f}us) (floor {floor:.2f}us, goal "
                      f"{goal:.1f}us, C={b.sim.producer_launch(R, L)[1]}) torch.topk[R,L] {tl} "
                      f"jax top_k[R,L] {jl}; merge {tm:.1f}us (rescued rows {sat0:.2f}) "
                      f"rescue-merge {tr:.1f}us torch.topk[R,W*N] {tmk} jax [R,W*N] {jm}",
                      flush=True)  # fmt: skip
        del b
    f = lambda v: "-" if v is None else f"{v:8.1f}"  # noqa: E731
    print(f"\nW={a.world} K={a.topk}; times in us (median, CUDA events / graph replay); copy bw "
          f"{bw / 1e12:.2f} TB/s; floor = max(one read of [R,L] bf16, one write of the pushed LL "
          f"rows); goal = max(6, 3 x floor); baselines: top-N of [R,L] bf16, top-K of random "
          f"int64 keys [R,W*N]")  # fmt: skip
    print(f"{'N':>5} {'R':>4} {'L':>7} {'C':>2} | {'sel+push':>8} {'kernel':>7} {'floor':>6} {'goal':>6} {'met':>3} "
          f"{'torch':>8} {'jax':>8} | {'merge':>8} {'+rescue':>8} {'torch':>8} {'jax':>8} {'sat':>4}")  # fmt: skip
    for n, R, L, tp, fl, goal, tl, jl, tm, tr, tmk, jm, s0, s1, c, kp in rows:
        print(f"{n:>5} {R:>4} {L:>7} {c:>2} | {tp:8.1f} {kp:7.1f} {fl:6.2f} {goal:6.1f} {'yes' if tp <= goal else 'no':>3} "
              f"{f(tl)} {f(jl)} | {tm:8.1f} {tr:8.1f} {f(tmk)} {f(jm)} {s1:4.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
