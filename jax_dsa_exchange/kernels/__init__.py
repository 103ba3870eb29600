"""CuTe DSL kernels (no JAX import): select+push and the exchange merge."""
