"""Phase profile of the kernels (timing only): SM clock marks of thread 0 at numbered points
(kernels/common.py Marks; merge.py / select.py / select_push.py ``mk(i)``), from builds with
``JAX_DSA_EXCHANGE_MERGE_TUNE=prof=1`` and ``JAX_DSA_EXCHANGE_SELECT_TUNE=prof=1``.

  build here (CuTe DSL), for each W / N profiled (W = 8 N = 512 and W = 16 N = 1024):
      JAX_DSA_EXCHANGE_MERGE_TUNE=prof=1 JAX_DSA_EXCHANGE_SELECT_TUNE=prof=1 \
        python -m jax_dsa_exchange.build --topk 2048 --local-topk 512 --world 8 --out .cubins
  run there (GPU, .cubins carried):
      JAX_DSA_EXCHANGE_CUBIN_DIR=.cubins PYTHONPATH=. python3 tools/phase_profile.py [--only merge|select]
  a select variant (built with JAX_DSA_EXCHANGE_SELECT_TUNE=prof=1,TUNE), other shapes / inputs:
      ... tools/phase_profile.py --only select --select-tune big=0,ratio=0 --shapes 1,32768,1 \
        --pattern recent
  a merge variant (built with JAX_DSA_EXCHANGE_MERGE_TUNE=prof=1,TUNE), e.g. the normal path
  without the rescue's code:  ... tools/phase_profile.py --only merge --merge-tune norescue=1

The merge stores CTA 0's marks over ids[0, K-N_MARKS:] (its last row); select_push stores each
CTA's marks of row 0 over the rescue sequence words of rows max_rows - 128 .. (unused here).  Printed: the median over iterations of each mark minus mark 0 (cycles, and us at
the clock given), next to the kernel's CUPTI duration.  Outputs of these builds are wrong
(never tested); the marks perturb the schedule a little (each is an S2R of the clock).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

def _arg(name):
    """An option's value from the command line before argparse runs ('' when absent)."""
    for i, a in enumerate(sys.argv):
        if a == name and i + 1 < len(sys.argv):
            return sys.argv[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return ""


# (set before the kernels are loaded: the tune strings pick the cubins; a merge variant, e.g.
# --merge-tune norescue=1, is built with JAX_DSA_EXCHANGE_MERGE_TUNE=prof=1,norescue=1)
os.environ["JAX_DSA_EXCHANGE_MERGE_TUNE"] = ",".join(filter(None, ["prof=1", _arg("--merge-tune")]))
os.environ["JAX_DSA_EXCHANGE_SELECT_TUNE"] = ",".join(filter(None, ["prof=1", _arg("--select-tune")]))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import numpy as np  # noqa: E402

from jax_dsa_exchange import layout  # noqa: E402
from jax_dsa_exchange.kernels.abi import MERGE_PROF_MARKS as N_MARKS  # noqa: E402
from jax_dsa_exchange.kernels.timing import KernelClock, KernelTimer  # noqa: E402

MERGE_MARKS = {
    1: "entry barrier", 2: "round-1 words in", 3: "block table issued", 4: "stats barrier",
    5: "score histogram + find", 6: "second histogram", 7: "tie-break", 8: "selection + warp totals",
    9: "output stores issued", 10: "outputs barrier", 11: "saturation", 12: "rescue done",
    13: "pdl_wait", 14: "epoch stored", 15: "end",
}
# a forced rescue's row: marks 2-10 are its round 2's (merge.round2_rolled), after 11 and 12
MERGE_MARKS_RESCUE = {**MERGE_MARKS, **{
    2: "r2: select + push + flags waited", 3: "r2: copies in (cp.async)", 4: "r2: stats barrier",
    5: "r2: score histogram + find", 6: "r2: second histogram", 7: "r2: tie-break",
    8: "r2: selection + warp totals", 9: "r2: output stores issued", 10: "r2: outputs barrier",
    16: "rescue: local select done", 17: "rescue: K-list pushed (barrier)", 18: "rescue: flags waited"}}
SELECT_MARKS = {
    1: "zeroing barrier", 2: "pass 1", 3: "cluster barrier 1", 4: "DSMEM sums + scan",
    5: "pass 2", 6: "hist2 walk", 7: "cluster barrier 2", 14: "boundary + refine (big)",
    8: "boundary (big: the list)", 9: "compaction walk 1",
    10: "compaction scan", 11: "compaction walk 2", 12: "cluster barrier 3", 13: "push",
}
# the lean image's (kernels/lean.py; twenty-fourth session)
LEAN_MARKS = {
    1: "zeroing barrier (loads issued)", 2: "pass 1", 3: "cluster barrier 1", 4: "window scan (b1) + barrier",
    5: "pass 2 + bin-b1 walk", 7: "cluster barrier 2", 8: "boundary (warp 0) + barrier", 9: "counts",
    10: "compaction scan", 11: "write walk", 12: "barrier", 13: "push",
}


def deltas(m):
    m = np.asarray(m, np.int64) & 0xFFFFFFFF
    return [(int(m[i]) - int(m[0])) & 0xFFFFFFFF if m[i] else None for i in range(len(m))]


def show(title, names, rows, ghz, kernel_us):
    """The marks in the order of their median time (a rescue's round 2 runs after mark 11)."""
    print(f"\n== {title}  (kernel {kernel_us:.2f} us CUPTI; us at {ghz} GHz; median of {len(rows)})")
    med = {}
    for i, name in names.items():
        vals = [r[i] for r in rows if r[i] is not None]
        if not vals:
            print(f"  {i:2d} {name:32s}        -")
            continue
        med[i] = statistics.median(vals)
    prev = 0
    for i in sorted(med, key=med.get):
        c = med[i]
        print(f"  {i:2d} {names[i]:32s} {c:8.0f} cyc {c / ghz / 1e3:7.2f} us  (+{(c - prev) / ghz / 1e3:5.2f})")
        prev = c


def merge_profile(cp, W, K, N, R, L, rescue, iters, ghz):
    b = KernelTimer(cp, W, K, N, R)
    sim = b.sim
    sets = b.inputs(R, L, 2, rescue, 0)
    rows = []
    clock = KernelClock()
    for it in range(iters + 3):
        d = sets[it % 2]
        if it == 3:
            clock.__enter__()
        for q in range(W):
            sim.launch_rank(q, d[q], R, L, 64, merge=False)
        cp.cuda.Device().synchronize()
        d[0]["ids"].fill(0)
        cp.cuda.Device().synchronize()
        sim.launch_rank(0, d[0], R, L, 64, producer=False, grid=max(1, min(R, 64)))
        sim.streams[0].synchronize()
        m = d[0]["ids"][0, K - N_MARKS:].get()
        for q in range(1, W):
            sim.launch_rank(q, d[q], R, L, 64, producer=False, grid=min(R, 8))
        cp.cuda.Device().synchronize()
        if it >= 3:
            rows.append(deltas(m))
    clock.__exit__(None, None, None)
    ks = [dd for i, (_, dd) in enumerate(clock.starts_and_durations("kernelsmerge")) if i % W == 0]
    show(f"merge W={W} K={K} N={N} R={R}{' forced rescue' if rescue else ''}",
         MERGE_MARKS_RESCUE if rescue else MERGE_MARKS, rows, ghz,
         statistics.median(ks) if ks else float("nan"))
    del b, sets


def select_profile(cp, W, K, N, R, L, iters, ghz, C=None, pattern="random"):
    mr = -(-(R + 128) // 4) * 4  # the marks go to the seq words of rows mr - 128 ..
    b = KernelTimer(cp, W, K, N, mr, pattern=pattern)
    sim = b.sim
    forced = C
    image, C = sim.producer_launch(R, L, C)
    sets = b.inputs(R, L, 1, False, 0)
    d = sets[0][0]
    per_cta = [[] for _ in range(C)]
    gts = []
    clock = KernelClock()
    for it in range(iters + 3):
        if it == 3:
            clock.__enter__()
        sim.launch_rank(0, d, R, L, 64, merge=False, cluster=forced)
        cp.cuda.Device().synchronize()
        st = sim.states[0].get().view(np.uint32)
        off = mr * layout.STATE_SEQ_ROWS + mr - 128
        raw = st[off: off + C * 16].reshape(C, 16)
        if it >= 3:
            for c in range(C):
                per_cta[c].append(deltas(raw[c][:15]))
            g = raw[:, 15].astype(np.int64)
            gts.append(g - g.min())
    clock.__exit__(None, None, None)
    ks = [dd for _, dd in clock.starts_and_durations("kernelsselect_push")]
    k = statistics.median(ks) if ks else float("nan")
    for c in range(C):
        show(f"{image} N={N} R={R} L={L} C={C} ({pattern}, tune "
             f"{os.environ['JAX_DSA_EXCHANGE_SELECT_TUNE']}): CTA {c} of row 0",
             LEAN_MARKS if image == "select_push_lean" else SELECT_MARKS, per_cta[c], ghz, k)
    sk = np.median(np.array(gts), axis=0)
    print(f"  start skew of the CTAs of row 0 (globaltimer, ns, median): {sk.astype(int).tolist()}")
    del b, sets


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--ghz", type=float, default=1.98)
    ap.add_argument("--only", choices=["merge", "select"], default=None)
    ap.add_argument("--select-tune", default="", help="select variant knobs beside prof=1 (read at import)")
    ap.add_argument("--merge-tune", default="", help="merge variant knobs beside prof=1 (read at import), "
                    "e.g. norescue=1: the normal path without the rescue's code")
    ap.add_argument("--shapes", nargs="+", default=None, help="select shapes R,L[,C] (C: forced)")
    ap.add_argument("--pattern", default="random", help="select inputs: random | recent")
    a = ap.parse_args(argv)
    import cupy as cp

    if a.only != "select":
        for W, N, R, rescue in ((8, 512, 1, False), (8, 512, 64, False), (8, 512, 1, True),
                                (16, 1024, 64, False)):  # fmt: skip
            if rescue and "norescue=1" in os.environ["JAX_DSA_EXCHANGE_MERGE_TUNE"]:
                continue  # (that build has no rescue)
            try:
                merge_profile(cp, W, 2048, N, R, 8192, rescue, a.iters, a.ghz)
            except FileNotFoundError as e:
                print(f"merge W={W} N={N}: no prof build ({e})")
    if a.only != "merge":
        shapes = [tuple(int(x) for x in sh.split(",")) for sh in a.shapes] if a.shapes else [
            (1, 8192), (1, 32768), (1, 131072), (16, 131072), (64, 131072)]
        for sh in shapes:
            select_profile(cp, 8, 2048, 512, sh[0], sh[1], a.iters, a.ghz, sh[2] if len(sh) > 2 else None,
                           a.pattern)  # fmt: skip


if __name__ == "__main__":
    main()
