"""One rank of the clean-exit test (tests/test_multiprocess.py::test_clean_exit_without_grpc_noise).

Joins the job through ``distributed.initialize``, runs a collective on the key-value store,
then leaves in the order given by ``--order``: ``leader-first`` (rank 0 returns at once,
the others 3 s later: the order that made every other rank print gRPC errors when the
coordinator went away first), ``leader-last`` or ``together``.  ``--raw`` skips the
package's exit handling (plain ``jax.distributed.initialize``), to show the noise."""

import argparse
import os
import sys
import time

p = argparse.ArgumentParser()
p.add_argument("--order", choices=("leader-first", "leader-last", "together"), default="leader-first")
p.add_argument("--raw", action="store_true")
a = p.parse_args()

from jax_dsa_exchange import distributed  # noqa: E402

if a.raw:
    import jax

    jax.distributed.initialize(os.environ[distributed.ENV_COORDINATOR], distributed.world(), distributed.rank())
    rank = distributed.rank()
else:
    rank, world = distributed.initialize()
import jax  # noqa: E402

from jax_dsa_exchange.rendezvous import distributed_client  # noqa: E402

c = distributed_client()
c.key_value_set(f"exit_test/{rank}", "1")
for q in range(jax.process_count()):
    c.blocking_key_value_get(f"exit_test/{q}", 30_000)
print(f"rank {rank} of {jax.process_count()}: RANK OK", flush=True)
if (a.order == "leader-first" and rank != 0) or (a.order == "leader-last" and rank == 0):
    time.sleep(3)
sys.exit(0)
