"""Does XLA record the dsa_* custom calls into CUDA graphs (command buffers)?

Run on a GPU machine from the repo root:  python ffi/testing/gpu_check.py OUTDIR

For each XLA_FLAGS setting it runs, in a fresh process, a jitted step (a few
fusions around topk_exchange_merge with the stand-in kernels of
fake_kernels.cu) and a lax.scan of 3 such steps, each 3 times, and reports:
  * whether the results are right (the stand-in merge returns the call's epoch,
    which advances once per call on the device);
  * how often the FFI handlers launched (dsa_launch_count): 2 per call when
    XLA calls the handlers each time, fewer when a recorded CUDA graph replays;
  * which HLO computations hold the custom calls after optimization (XLA wraps
    command-buffer sequences into computations named command_buffer*).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

# name: (XLA_FLAGS, extra environment)
CONFIGS = {
    "default": ("", {}),
    "handlers_without_graph_trait": ("", {"JAX_DSA_EXCHANGE_CUDA_GRAPHS": "0"}),
    "min_graph_size_1": ("--xla_gpu_graph_min_graph_size=1", {}),
    "command_buffers_off": ("--xla_gpu_enable_command_buffer=", {}),
}

HERE = os.path.dirname(os.path.abspath(__file__))


def computations_with(text: str, needle: str) -> list[str]:
    """Names of the HLO computations (top-level blocks) whose body contains needle."""
    names, cur, hit = [], None, False
    for line in text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            cur, hit = line.split()[0] if not line.startswith("ENTRY") else "ENTRY " + line.split()[1], False
        elif line.startswith("}"):
            if hit:
                names.append(cur)
            cur = None
        elif cur and needle in line:
            hit = True
    return names


def child(cfg: str, dump: str) -> None:
    flags, env = CONFIGS[cfg]
    os.environ.update(env)
    os.environ["XLA_FLAGS"] = f"{flags} --xla_dump_to={dump} --xla_dump_hlo_as_text"
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    import glob

    import cupy as cp
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax

    from jax_dsa_exchange import _ffi
    from jax_dsa_exchange.op import topk_exchange_merge

    tmp = os.path.join(dump, "k")
    os.makedirs(tmp, exist_ok=True)
    cu = os.path.join(HERE, "fake_kernels.cu")
    subprocess.run(["nvcc", "-cubin", "-arch=sm_90a", "-o", f"{tmp}/f.cubin", cu], check=True)
    cubin = open(f"{tmp}/f.cubin", "rb").read()
    dev = jax.devices()[0].local_hardware_id
    max_rows, rows, cols = 8, 4, 128
    with cp.cuda.Device(dev):
        state = cp.zeros(2 * max_rows + 8, cp.int32)
        buf = cp.zeros(4 * max_rows, cp.int32)
        peers = cp.asarray([buf.data.ptr], cp.int64)
        cp.cuda.Device(dev).synchronize()
    from jax_dsa_exchange.kernels.abi import MERGE as MG
    from jax_dsa_exchange.kernels.abi import SELECT_PUSH as SP

    _ffi.load_kernel("g_sel", SP.kernel, SP.pairs(), cubin, None, "fake_select_push", dev, 128, 0)
    _ffi.load_kernel("g_merge", MG.kernel, MG.pairs(), cubin, None, "fake_merge", dev, 128, 64 << 10)
    _ffi.register_exchange(5, dev, rank=0, world=1, topk=64, local_topk=32, max_rows=max_rows,
                           peers=peers.data.ptr, local=buf.data.ptr, state=state.data.ptr, rescue_off=0,
                           flags_off=0, timeout_us=1000, merge_grid=2, select_key="g_sel", merge_key="g_merge")

    class Ex:
        id, world, rank, topk, local_topk, closed = 5, 1, 0, 64, 32, False

    Ex.max_rows = max_rows

    def step(lg, re_, rq, bt):
        lg2 = (lg.astype(jnp.float32) * 1.5 + 0.25).astype(jnp.bfloat16)
        o = topk_exchange_merge(Ex(), lg2, re_ + 1, rq, bt * 2, block_size=4, with_saturated=True, path="ffi")
        return o.saturated * 2 + jnp.sum(o.counts) * 0

    def scanned(lg, re_, rq, bt):
        def body(c, _):
            return c + step(lg, re_, rq, bt), None

        return lax.scan(body, jnp.zeros((rows,), jnp.int32), None, length=3)[0]

    args = (jnp.ones((rows, cols), jnp.bfloat16), jnp.full((rows,), 10, jnp.int32),
            jnp.zeros((rows,), jnp.int32), jnp.ones((2, 8), jnp.int32))
    report = {"cfg": cfg, "flags": flags, "env": env, "ok": True, "plain_launches": [], "scan_launches": []}
    epoch = 0
    plain = jax.jit(step)
    for name, fn, per in (("plain", plain, 1), ("scan", jax.jit(scanned), 3)):
        for _ in range(3):
            before = _ffi.launch_count()
            out = np.asarray(jax.block_until_ready(fn(*args)))
            report[f"{name}_launches"].append(_ffi.launch_count() - before)
            want = 2 * sum(range(epoch + 1, epoch + per + 1))
            epoch += per
            if not (out == want).all():
                report["ok"] = False
                report.setdefault("bad", []).append((name, out.tolist(), want))
    jax.effects_barrier()
    cp.cuda.Device(dev).synchronize()
    report["device_epochs"] = cp.asnumpy(state[:rows]).tolist()
    report["expected_epoch"] = epoch
    for mod in ("jit_step", "jit_scanned"):
        files = sorted(glob.glob(f"{dump}/*{mod}*after_optimizations.txt"))
        if files:
            text = open(files[-1]).read()
            report[f"{mod}_holds_dsa_merge"] = computations_with(text, 'custom_call_target="dsa_merge"')
            report[f"{mod}_holds_dsa_select_push"] = computations_with(text, 'custom_call_target="dsa_select_push"')
            report[f"{mod}_command_buffer_comps"] = [
                c for c in computations_with(text, "") if "command_buffer" in c
            ]
    import time

    for name, fn in (("plain", plain),):
        jax.block_until_ready(fn(*args))
        t0 = time.perf_counter()
        for _ in range(200):
            out = fn(*args)
        jax.block_until_ready(out)
        report[f"{name}_us_per_call"] = round((time.perf_counter() - t0) / 200 * 1e6, 1)
    # Lifetime hazard: after unregistering, does the already compiled step
    # still run (a recorded graph replays) or does the handler report it?
    _ffi.unregister_exchange(5, dev)
    before = _ffi.launch_count()
    try:
        out = np.asarray(jax.block_until_ready(plain(*args)))
        report["after_unregister"] = f"ran without error: {out.tolist()}"
    except Exception as e:  # noqa: BLE001
        report["after_unregister"] = f"error: {str(e)[:200]}"
    report["after_unregister_launches"] = _ffi.launch_count() - before
    print("REPORT " + json.dumps(report), flush=True)


def main() -> None:
    out = sys.argv[1]
    for cfg in CONFIGS:
        dump = os.path.join(out, "dump_" + cfg)
        os.makedirs(dump, exist_ok=True)
        r = subprocess.run([sys.executable, __file__, "--child", cfg, dump], capture_output=True, text=True,
                           timeout=240)
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith("REPORT ")]
        print(lines[-1] if lines else f"REPORT {cfg} FAILED rc={r.returncode}\n{r.stderr[-4000:]}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3])
    else:
        main()
