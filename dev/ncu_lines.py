"""Per-source-line totals of an ncu SASS source-counter CSV, mapped through a cubin
built with line info (CUTE_DSL_LINEINFO=1; the same SASS as the profiled build, checked by
instruction count):

    python3 dev/ncu_lines.py rep_sass.csv lineinfo.cubin [--top 40]

The CSV: ``ncu --section SourceCounters -o REP python3 ...`` on the GPU, then
``ncu -i REP.ncu-rep --page source --csv --print-source sass > rep_sass.csv``.

Needs nvdisasm (NVDISASM or on PATH); ``--src /path/of/the/build /checkout/of/that/revision``
when the sources changed since the line-info build.  Prints, per Python line (innermost location),
instructions executed and warp-stall samples, largest first, with the line's text."""

from __future__ import annotations

import argparse
import collections
import csv
import os
import re
import subprocess


def line_map(cubin: str, nvdisasm: str) -> list:
    out = subprocess.run([nvdisasm, "-c", "--print-line-info", cubin], capture_output=True, text=True).stdout
    cur, locs = None, []
    for ln in out.splitlines():
        m = re.search(r'//## File "([^"]+)", line (\d+)', ln)
        if m:
            if "inlined at" not in ln:
                cur = (m.group(1), int(m.group(2)))
            continue
        if re.search(r"/\*[0-9a-f]{4,}\*/", ln):
            locs.append(cur)
    return locs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("cubin")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--src", nargs=2, metavar=("FROM", "TO"), default=None,
                    help="read the source text under TO instead of FROM (a checkout of the profiled revision)")
    a = ap.parse_args()
    nvd = os.environ.get("NVDISASM", "nvdisasm")
    locs = line_map(a.cubin, nvd)
    rows = list(csv.reader(open(a.csv)))
    hi = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    hdr, data = rows[hi], rows[hi + 1:]
    if len(data) != len(locs):
        raise SystemExit(f"{len(data)} SASS lines profiled, {len(locs)} in the cubin: not the same build")
    iS, iE = hdr.index("Warp Stall Sampling (All Samples)"), hdr.index("Instructions Executed")
    reasons = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
    inst, samp = collections.Counter(), collections.Counter()
    why = collections.defaultdict(collections.Counter)
    for loc, r in zip(locs, data):
        inst[loc] += int(r[iE] or 0)
        samp[loc] += int(r[iS] or 0)
        for h in reasons:
            why[loc][h] += int(r[hdr.index(h)] or 0)
    ts, ti = sum(samp.values()), sum(inst.values())
    print(f"{ti} warp instructions, {ts} stall samples")
    src = {}
    for loc in sorted(samp, key=lambda k: -samp[k])[: a.top]:
        f, n = loc or ("?", 0)
        if f not in src:
            g = f.replace(a.src[0], a.src[1], 1) if a.src else f
            src[f] = open(g).read().splitlines() if os.path.exists(g) else []
        text = src[f][n - 1].strip() if 0 < n <= len(src[f]) else ""
        top = ", ".join(f"{h[6:]} {c}" for h, c in why[loc].most_common(2) if c)
        print(f"{100 * samp[loc] / ts:5.1f}% smp {100 * inst[loc] / ti:5.1f}% ins  {os.path.basename(f)}:{n:<5} "
              f"{text[:70]:70s} [{top}]")


if __name__ == "__main__":
    main()
