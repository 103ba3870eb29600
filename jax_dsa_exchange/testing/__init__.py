"""Test support, not the library: ``cases`` (the shared random and adversarial
inputs) and ``sim`` (W ranks of the exchange on one GPU through CuPy, for the kernel
tests and benchmarks).  Nothing in the library imports this package."""
