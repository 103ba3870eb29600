"""Experiment (twenty-sixth session): the lean image over non-portable clusters of 16 CTAs
(a build with JAX_DSA_EXCHANGE_SELECT_TUNE=lcm=16; the launchers stay <= 8): rows byte-identical
to reference.pack_local_topk at C = 16 (and 8, the same build), then the kernel's CUPTI duration
at the R = 1..4, L = 64K / 128K shapes against C = 8.  W = 8, K = 2048, N = 512."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]


def main():
    import numpy as np

    from jax_dsa_exchange import reference
    from jax_dsa_exchange.testing import cases
    from jax_dsa_exchange.testing.sim import Sim
    from test_select_gpu import _launch_and_check, _logits, _row_ends

    n = int(os.environ.get("PROBE_N", "512"))
    sim = Sim(8, 2048, n, 64, producer="select_push_lean")
    rng = np.random.default_rng(5)
    ok = 0
    for kind in ("random", "ties", "equal", "specials", "recent", "runs"):
        for L, rows in ((131072, 17), (100000, 4), (65536, 3), (70001, 2)):
            logits = _logits(kind, rows, L, rng)
            ends = rng.permutation(_row_ends(n, L, rows, rng))
            want = [reference.pack_local_topk(logits[t].view(np.uint16), ends[t], n) for t in range(rows)]
            d = sim.upload(cases.Case("c16", 8, 2048, n, 16, [logits] * 8, [ends] * 8,
                                      [np.zeros(rows, np.int32)] * 8,
                                      [np.zeros((1, -(-L // 16)), np.int32)] * 8))[0]  # fmt: skip
            for c in (16, 8):
                if sim.producer_image(L, c) != "select_push_lean":
                    continue
                for b in sim.bufs:
                    b.fill(0)
                _launch_and_check(sim, d, rows, L, c, want, ends, f"{kind} L={L} R={rows} C={c}")
                ok += 1
    print(f"exactness: {ok} launches byte-identical (C = 16 and 8)", flush=True)
    del sim


if __name__ == "__main__":
    main()
