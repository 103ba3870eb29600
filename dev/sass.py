"""What ptxas made of a kernel image: its SASS (nvdisasm), registers / stack / local memory
(cuobjdump), instruction counts by kind, and the launch prologue's order of memory
instructions and barriers.  A static check of a kernel change made without a GPU: the PTX
is what the DSL asked for, the SASS is what runs (e.g. whether ptxas if-converted a branch,
or where it issues a load relative to the first barrier).

Needs nvdisasm and cuobjdump, which CUDA's pip wheels ship (no GPU, no toolkit):
  pip install nvidia-cuda-nvdisasm nvidia-cuda-cuobjdump      (or NVDISASM= / CUOBJDUMP=)

  python dev/sass.py .cubins/sm_90a-w8-k2048-n512-<tag> [--image merge] [--diff OTHER_DIR]
      [--prologue 40] [--dump FILE]
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import shutil
import subprocess
import sys
import sysconfig

# instruction kinds counted (first matching prefix wins; the opcode without its modifiers)
KINDS = [
    ("global load", ("LDG",)), ("global store", ("STG",)), ("global atomic", ("ATOMG", "REDG", "RED")),
    ("shared load", ("LDS", "LDSM")), ("shared store", ("STS",)), ("shared atomic", ("ATOMS",)),
    ("DSMEM / generic", ("LD", "ST", "ATOM")), ("local (spill)", ("LDL", "STL")),
    ("barrier", ("BAR", "UCGABAR", "SYNCS", "MEMBAR", "WARPSYNC", "BSYNC", "BSSY")),
    ("shuffle / vote / redux", ("SHFL", "VOTE", "VOTEU", "REDUX", "MATCH")),
    ("branch / call", ("BRA", "BRX", "CALL", "RET", "EXIT", "JMP")),
    ("prefetch / cache", ("CCTL",)),
]
_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)(.*?);")


def tool(name: str) -> str:
    """The path of nvdisasm / cuobjdump: $NAME, PATH, or a CUDA pip wheel's bin folder."""
    env = os.environ.get(name.upper())
    if env:
        return env
    found = shutil.which(name)
    if found:
        return found
    for root in {sysconfig.get_paths()["purelib"], *sys.path}:
        for cand in glob.glob(os.path.join(root, "nvidia", "cu1*", "bin", name)):
            return cand
    raise SystemExit(f"{name} not found: pip install nvidia-cuda-{name} (or set {name.upper()}=path)")


def parse(text: str) -> list:
    """[(address, predicate, opcode, operands)] of nvdisasm's listing, in address order."""
    return [(int(m.group(1), 16), (m.group(2) or "").strip(), m.group(3), m.group(4).strip())
            for m in map(_LINE.search, text.splitlines()) if m]


def plain(cubin: str) -> str:
    """A path the tools can read: the cubin itself, or its gzip copy (dev/pack_cubins.sh)
    unpacked into a temporary file."""
    if not cubin.endswith(".gz"):
        return cubin
    import gzip
    import tempfile

    with open(cubin, "rb") as f, tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as out:
        out.write(gzip.decompress(f.read()))
    return out.name


def sass(cubin: str) -> list:
    """parse() of the cubin's disassembly."""
    return parse(subprocess.run([tool("nvdisasm"), "-c", plain(cubin)], capture_output=True, text=True,
                                check=True).stdout)  # fmt: skip


def resources(cubin: str) -> dict:
    """REG / STACK / LOCAL / SHARED of the cubin's kernel (cuobjdump --dump-resource-usage)."""
    out = subprocess.run([tool("cuobjdump"), "--dump-resource-usage", plain(cubin)], capture_output=True,
                         text=True, check=True).stdout  # fmt: skip
    return {k: int(v) for k, v in re.findall(r"\b(REG|STACK|LOCAL|SHARED):(\d+)", out)}


def kind(op: str) -> str:
    base = op.split(".")[0]
    for name, prefixes in KINDS:
        if base in prefixes:
            return name
    return "other"


def summary(cubin: str) -> dict:
    ins = sass(cubin)
    s = dict(resources(cubin))
    s["instructions"] = len(ins)
    s.update(collections.Counter(kind(op) for _, _, op, _ in ins))
    return s


def prologue(ins: list, n: int) -> list:
    """The first n memory instructions, barriers, branches and calls of parse()'s list, in
    address order (the order in which a launch issues them, up to its first branch)."""
    out = []
    for addr, pred, op, args in ins:
        k = kind(op)
        if k != "other" and k != "shuffle / vote / redux":
            out.append(f"{addr:06x} {pred:6s} {op} {args}"[:110])
        if len(out) >= n:
            break
    return out


def image_name(path: str) -> str:
    """merge.cubin / merge.cubin.gz -> merge."""
    b = os.path.basename(path)
    return b[:-len(".cubin.gz")] if b.endswith(".gz") else b[:-len(".cubin")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", help="a prebuilt folder (jax_dsa_exchange.build --out) or one .cubin[.gz]")
    ap.add_argument("--image", action="append", help="image name(s) (default: every .cubin of the folder)")
    ap.add_argument("--diff", help="a second folder: the same images side by side")
    ap.add_argument("--prologue", type=int, default=0, help="list the first N memory / barrier instructions")
    ap.add_argument("--dump", help="write the whole SASS of the (first) image here")
    a = ap.parse_args()
    if a.folder.endswith((".cubin", ".cubin.gz")):
        cubins = {image_name(a.folder): a.folder}
    else:
        cubins = {image_name(p): p for p in sorted(glob.glob(os.path.join(a.folder, "*.cubin"))
                                                  + glob.glob(os.path.join(a.folder, "*.cubin.gz")))}
    if a.image:
        cubins = {k: v for k, v in cubins.items() if k in a.image}
    if not cubins:
        raise SystemExit(f"no cubin in {a.folder}" + (f" named {a.image}" if a.image else ""))
    for name, path in cubins.items():
        cols = [("", summary(path))]
        if a.diff:
            for other in (os.path.join(a.diff, name + ".cubin"), os.path.join(a.diff, name + ".cubin.gz")):
                if os.path.exists(other):
                    cols.append(("other", summary(other)))
                    break
        keys = ["REG", "STACK", "LOCAL", "instructions"] + [k for k, _ in KINDS] + ["other"]
        print(f"== {name}  ({path})" + (f"  vs  {a.diff}" if len(cols) > 1 else ""))
        for k in keys:
            vals = [c.get(k, 0) for _, c in cols]
            extra = f"  {vals[1] - vals[0]:+d}" if len(vals) > 1 and vals[1] != vals[0] else ""
            print(f"  {k:24s} " + " ".join(f"{v:8d}" for v in vals) + extra)
        if a.prologue:
            print(f"  -- the first {a.prologue} memory / barrier / branch instructions")
            for line in prologue(sass(path), a.prologue):
                print("   ", line)
        if a.dump:
            with open(a.dump, "w") as f:
                f.write(subprocess.run([tool("nvdisasm"), "-c", plain(path)], capture_output=True, text=True,
                                       check=True).stdout)  # fmt: skip
            a.dump = None


if __name__ == "__main__":
    main()
