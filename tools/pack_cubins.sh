#!/bin/bash
# gzip the PTX and the cubins of every prebuilt folder (default .cubins) so that more builds fit
# the device machine's 64 MiB carry (~3x smaller; kernels/cache.py reads <name>.gz where <name>
# is absent: read_packed; tools/sass.py reads either).  Idempotent.
set -e
D=${1:-.cubins}
find "$D" \( -name '*.ptx' -o -name '*.cubin' \) -exec gzip -9f {} +
echo "$D: $(du -sh "$D" | cut -f1)"
