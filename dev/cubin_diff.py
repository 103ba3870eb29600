"""Are two builds of the kernels byte-identical?

    python dev/cubin_diff.py NEW_DIR OLD_DIR [--both-ways] [--quiet]

NEW_DIR and OLD_DIR are folders of prebuilt kernels (``python -m jax_dsa_exchange.build --out``
or dev/build_cubins.py), e.g. the build of a refactored source tree and that of the tree before.
Each configuration folder of NEW_DIR (``<arch>-w<W>-k<K>-n<N>[-rl]-<source hash>``) is paired
with the folder of the same configuration in OLD_DIR whatever its source hash (which differs
whenever a source file changed, a comment included); then every image must be there on both
sides, with the same cubin bytes and the same launch metadata (entry, parameters, block, shared
memory, cluster, split, configuration).  Plain and gzipped (dev/pack_cubins.sh) files compare
alike.  The PTX is not compared: it carries source line information, while the cubin is what runs.

Prints one line per difference and "N identical, M different, K missing"; exit status 0 when
every image of NEW_DIR is identical to OLD_DIR's (``--both-ways``: and OLD_DIR has no
configuration NEW_DIR lacks), 1 otherwise, 2 on a usage error.  Standard library only.
"""

from __future__ import annotations

import argparse
import gzip
import json
import pathlib
import re
import sys

# a configuration folder: the tag of kernels/cache.py config_tag (hash: its first 16 hex digits)
TAG = re.compile(r"^(?P<config>.+-w\d+-k\d+-n\d+(?:-rl)?(?:-i\d+)?)-(?P<hash>[0-9a-f]{16})$")
# configuration keys a build may leave out, at these values (builds older than the key)
CONFIG_DEFAULTS = {"interleave": 1}
# metadata that differs between builds of identical kernels: the source hash, the compile time,
# the grid's documentation text, the file names
IGNORED = ("source_hash", "compile_seconds", "grid", "cubin", "ptx")


def configs(folder: pathlib.Path) -> dict:
    """{configuration: [folders]} of the complete configuration folders (merge.json present)."""
    out: dict = {}
    for d in sorted(folder.iterdir()):
        m = TAG.match(d.name)
        if m and d.is_dir() and (d / "merge.json").is_file():
            out.setdefault(m.group("config"), []).append(d)
    return out


def images(folder: pathlib.Path) -> list:
    """The image names of a configuration folder (one JSON each)."""
    return sorted(p.name[: -len(".json")] for p in folder.glob("*.json") if not p.name.startswith("."))


def read(path: pathlib.Path) -> bytes | None:
    """A file's bytes, or those of its gzip copy; None when neither exists."""
    if path.is_file():
        return path.read_bytes()
    gz = path.with_name(path.name + ".gz")
    return gzip.decompress(gz.read_bytes()) if gz.is_file() else None


def metadata(folder: pathlib.Path, name: str) -> dict:
    meta = json.loads((folder / f"{name}.json").read_text())
    if isinstance(meta.get("config"), dict):
        meta["config"] = {**CONFIG_DEFAULTS, **meta["config"]}
    return {k: v for k, v in meta.items() if k not in IGNORED}


def compare_image(new: pathlib.Path, old: pathlib.Path, name: str) -> list:
    """What differs between image ``name`` of two configuration folders ([]: identical)."""
    why = []
    mn, mo = metadata(new, name), metadata(old, name)
    a = read(new / json.loads((new / f"{name}.json").read_text()).get("cubin", f"{name}.cubin"))
    b = read(old / json.loads((old / f"{name}.json").read_text()).get("cubin", f"{name}.cubin"))
    if a is None or b is None:
        why.append("cubin file missing" + (" in NEW" if a is None else "") + (" in OLD" if b is None else ""))
    elif a != b:
        why.append(f"cubin bytes ({len(a)} vs {len(b)} bytes)")
    for k in sorted(set(mn) | set(mo)):
        if mn.get(k) != mo.get(k):
            why.append(f"{k}: {mn.get(k)!r} vs {mo.get(k)!r}")
    return why


def diff(new_dir: pathlib.Path, old_dir: pathlib.Path, both_ways: bool = False) -> tuple:
    """(identical images, lines describing each difference, missing configurations)."""
    new, old = configs(new_dir), configs(old_dir)
    same, lines, missing = 0, [], 0
    for cfg, folders in new.items():
        if len(folders) > 1:
            lines.append(f"AMBIGUOUS {cfg}: {len(folders)} builds in NEW ({', '.join(f.name for f in folders)})")
            continue
        if cfg not in old:
            lines.append(f"MISSING {cfg}: not in OLD")
            missing += 1
            continue
        if len(old[cfg]) > 1:
            lines.append(f"AMBIGUOUS {cfg}: {len(old[cfg])} builds in OLD ({', '.join(f.name for f in old[cfg])})")
            continue
        n, o = folders[0], old[cfg][0]
        names_n, names_o = images(n), images(o)
        if names_n != names_o:
            lines.append(f"DIFFERENT {cfg}: images {names_n} vs {names_o}")
        for name in sorted(set(names_n) & set(names_o)):
            why = compare_image(n, o, name)
            if why:
                lines.append(f"DIFFERENT {cfg} {name}: " + "; ".join(why))
            else:
                same += 1
    if both_ways:
        for cfg in old:
            if cfg not in new:
                lines.append(f"MISSING {cfg}: not in NEW")
                missing += 1
    return same, lines, missing


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python dev/cubin_diff.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("new", type=pathlib.Path, help="a folder of prebuilt kernels (the build to check)")
    ap.add_argument("old", type=pathlib.Path, help="a folder of prebuilt kernels (the reference build)")
    ap.add_argument("--both-ways", action="store_true", help="also fail on configurations OLD has and NEW lacks")
    ap.add_argument("--quiet", action="store_true", help="print the summary line only")
    a = ap.parse_args(argv)
    for d in (a.new, a.old):
        if not d.is_dir():
            ap.error(f"{d}: not a folder")
    same, lines, missing = diff(a.new, a.old, a.both_ways)
    if not a.quiet:
        for line in lines:
            print(line)
    different = sum(1 for line in lines if not line.startswith("MISSING"))
    if same + different + missing == 0:
        print(f"no configuration folder in {a.new}")
        return 1
    print(f"{same} identical, {different} different, {missing} missing")
    return 0 if not lines else 1


if __name__ == "__main__":
    sys.exit(main())
