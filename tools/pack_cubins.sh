#!/bin/bash
# gzip the PTX of every prebuilt folder (default .cubins) so that more builds fit the device
# machine's 64 MiB carry: the PTX is ~70% of a folder, and only the JIT fallback reads it
# (kernels/cache.py reads <name>.ptx.gz where <name>.ptx is absent).  Idempotent.
set -e
D=${1:-.cubins}
find "$D" -name '*.ptx' -exec gzip -9f {} +
echo "$D: $(du -sh "$D" | cut -f1)"
