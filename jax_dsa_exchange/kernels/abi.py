"""The launch ABI of the two kernels, declared once (no CuTe DSL, no CUDA import).

Every kernel parameter is a plain 64-bit address / integer (``"i64"``) or a 32-bit
integer (``"i32"``), passed in the order declared here.  Everything else derives
from these declarations:

* the CuTe DSL ``kernel`` / ``entry`` signatures (spelled out, as the DSL needs
  explicit Python parameters; tests/test_kernels_compile.py checks them against
  :data:`KERNELS` with ``inspect.signature``) and their compile dummies
  (:meth:`KernelABI.dummies`);
* the metadata JSON's ``"params"`` (kernels/cache.py);
* the one-GPU simulator's argument packing (:meth:`KernelABI.pack`,
  jax_dsa_exchange/testing/sim.py);
* the C++ launcher, which receives the metadata's names at load
  (``dsa_load_kernel``) and packs its values by name; it refuses any other set
  of names (tests/test_ffi.py), and ffi/testing/fake_kernels.cu is checked
  against the same declarations.
"""

from __future__ import annotations

import dataclasses

TYPES = ("i64", "i32")


@dataclasses.dataclass(frozen=True)
class Param:
    name: str
    type: str  # "i64" | "i32"
    dummy: int  # the value it is compiled with (any value compiles the same code)


@dataclasses.dataclass(frozen=True)
class KernelABI:
    kernel: str
    params: tuple  # (Param, ...) in launch order

    def __post_init__(self):
        names = [p.name for p in self.params]
        assert len(set(names)) == len(names), names
        assert all(p.type in TYPES for p in self.params), self.params

    @property
    def names(self) -> tuple:
        return tuple(p.name for p in self.params)

    def pairs(self) -> tuple:
        """((name, type), ...): the metadata's ``"params"``."""
        return tuple((p.name, p.type) for p in self.params)

    def spec(self) -> str:
        """``"name:type,..."``: what the C++ launcher receives at load."""
        return ",".join(f"{p.name}:{p.type}" for p in self.params)

    def dummies(self, i64, i32) -> list:
        """Compile-time arguments, built with the DSL's ``Int64`` / ``Int32``."""
        return [(i64 if p.type == "i64" else i32)(p.dummy) for p in self.params]

    def pack(self, values: dict) -> list:
        """Values of exactly the declared names -> list in launch order."""
        if set(values) != set(self.names):
            missing, extra = set(self.names) - set(values), set(values) - set(self.names)
            raise ValueError(f"{self.kernel}: missing params {sorted(missing)}, unknown {sorted(extra)}")
        return [int(values[n]) for n in self.names]


def _params(spec: str) -> tuple:
    out = []
    for item in spec.split():
        name, typ, *dummy = item.split(":")
        out.append(Param(name, typ, int(dummy[0]) if dummy else (0 if typ == "i64" else 1)))
    return tuple(out)


# kernels/select_push.py (docs/DESIGN.md §6.1).  Addresses: logits bf16 [rows, cols]
# row-major, row_ends int32 [rows], epoch = this rank's state (layout.StateLayout),
# peers int64 [W] device table of every rank's buffer base; cache_tokens = layout.
# producer_cache_tokens (the launch's dynamic shared memory holds that many ord16).
SELECT_PUSH = KernelABI("select_push", _params(
    "logits:i64 row_ends:i64 rows:i32 cols:i32 epoch:i64 peers:i64 rank:i32:0 max_rows:i32 "
    "cache_tokens:i32:0"))

# kernels/merge.py (docs/DESIGN.md §6.2-§6.7).  ids / saturated: 0 = not wanted;
# rescue_off / flags_off: byte offsets in the symmetric buffer (layout.BufferLayout);
# host_status: pinned host words [code, row, epoch, rank] the kernel fills when this
# exchange's status is set (0 = none): the host reads them without a sync.
MERGE = KernelABI("merge", _params(
    "peers:i64 local:i64 state:i64 logits:i64 row_ends:i64 req_id:i64 block_table:i64 "
    "kv_rows:i64 counts:i64 ids:i64 saturated:i64 rows:i32 cols:i32 bt_rows:i32 bt_cols:i32 "
    "block_size:i32 rank:i32:0 max_rows:i32 rescue_off:i64 flags_off:i64 timeout_us:i32 host_status:i64"))

KERNELS = {k.kernel: k for k in (SELECT_PUSH, MERGE)}

# Merge constants that tests need without the CuTe DSL (kernels/merge.py takes them from here):
# the most keys at the boundary score tie-broken by ranking (more take three histograms of g),
# and the merge_wide image's most CTAs per clustered row.
MERGE_EQ_MAX = 256
MERGE_CLUS_WIDE = 4
