#!/bin/bash
# gzip the PTX and the cubins of every prebuilt folder (default .cubins): about 3x smaller to copy
# to a GPU node.  kernels/cache.py reads <name>.gz where <name> is absent (read_packed), and
# dev/sass.py reads either.  Idempotent.
set -euo pipefail
D=${1:-.cubins}
[ -d "$D" ] || { echo "$D: no such folder" >&2; exit 1; }
find "$D" \( -name '*.ptx' -o -name '*.cubin' \) -exec gzip -9f {} +
echo "$D: $(du -sh "$D" | cut -f1)"
