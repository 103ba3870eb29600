"""Test and benchmark support, not the library: ``cases`` (the shared random and
adversarial inputs), ``sim`` (W ranks of the exchange on one GPU through CuPy, for the
kernel tests and benchmarks) and ``timing`` (device timing of the raw kernels on the
simulated ranks: benchmarks/bench_kernels.py and the benchmark commands).  The op, the
exchange and the kernels import nothing of this package."""
