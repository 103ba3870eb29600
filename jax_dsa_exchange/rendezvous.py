"""Collective agreement of the ranks of one exchange, over the jax.distributed key-value store.

Creating an exchange is collective (docs/DESIGN.md §7): every rank publishes a record, reads
every other rank's, and checks that they agree.  Every rank reads all records and
applies the same checks, so a mismatch is detected, and reported with the same
message, on every rank; a rank that never publishes makes every other rank fail
after ``timeout_s`` with its number named.  Keys are unique per exchange (its id
and name), since the store refuses to overwrite.
"""

from __future__ import annotations

import json
from typing import Any, Sequence


class RendezvousError(RuntimeError):
    """The ranks of an exchange disagree, or one of them did not arrive."""


def distributed_client():
    """The jax.distributed client, or None when jax.distributed is not initialized."""
    from ._jax_private import distributed_state

    return distributed_state().client


class Rendezvous:
    """Publish/gather of small JSON records among ``world`` ranks under ``prefix``."""

    def __init__(self, client, *, world: int, rank: int, prefix: str, timeout_s: float):
        if client is None:
            raise RendezvousError(
                "jax.distributed is not initialized: a multi-process exchange needs its "
                "key-value store (call jax_dsa_exchange.distributed.initialize() or "
                "jax.distributed.initialize() first, or use Exchange.create_local)"
            )
        self.client, self.world, self.rank = client, world, rank
        self.prefix, self.timeout_ms = prefix, max(1, int(timeout_s * 1000))

    def _key(self, tag: str, rank: int) -> str:
        return f"{self.prefix}/{tag}/{rank}"

    def allgather(self, tag: str, record: Any) -> list[Any]:
        """Every rank's ``record`` for ``tag``, in rank order."""
        self.client.key_value_set(self._key(tag, self.rank), json.dumps(record))
        out = []
        for q in range(self.world):
            try:
                raw = self.client.blocking_key_value_get(self._key(tag, q), self.timeout_ms)
            except Exception as e:  # the store raises its own error type on deadline
                raise RendezvousError(
                    f"{self.prefix}: rank {q} of {self.world} did not publish '{tag}' within "
                    f"{self.timeout_ms / 1000:.1f} s (seen from rank {self.rank}): {e}"
                ) from None
            out.append(json.loads(raw))
        return out

    def check_all_ok(self, tag: str, error: str | None) -> None:
        """Second phase: every rank says whether its local step worked; any failure fails all."""
        statuses = self.allgather(tag, error or "")
        bad = [(q, s) for q, s in enumerate(statuses) if s]
        if bad:
            detail = "; ".join(f"rank {q}: {s}" for q, s in bad)
            raise RendezvousError(f"{self.prefix}: '{tag}' failed on {len(bad)} rank(s): {detail}")


def check_agreement(records: Sequence[dict], keys: Sequence[str], what: str) -> None:
    """Raise naming the first rank whose ``keys`` differ from rank 0's."""
    first = records[0]
    for q, rec in enumerate(records):
        diff = [k for k in keys if rec.get(k) != first.get(k)]
        if diff:
            detail = ", ".join(f"{k}={rec.get(k)!r} on rank {q} but {first.get(k)!r} on rank 0" for k in diff)
            raise RendezvousError(f"{what}: ranks disagree: {detail}")
