"""One process of tests/test_rendezvous.py: agree (or fail to agree) with the other ranks."""

import sys

import jax

port, nproc, rank, scenario = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", nproc, rank, initialization_timeout=60)

from jax_dsa_exchange.rendezvous import (Rendezvous, RendezvousError, check_agreement,
                                         distributed_client)

world = nproc + 1 if scenario == "missing" else nproc
rdv = Rendezvous(distributed_client(), world=world, rank=rank, prefix="t/1", timeout_s=3)
record = dict(topk=2048, local_topk=512)
if scenario == "mismatch" and rank == 1:
    record["topk"] = 1024
try:
    records = rdv.allgather("config", record)
    check_agreement(records, ("topk", "local_topk"), "exchange 1")
    rdv.check_all_ok("opened", "IPC open failed" if scenario == "ipcfail" and rank == 0 else None)
    print("AGREED", flush=True)
except RendezvousError as e:
    print("ERROR", e, flush=True)
