"""CuTe DSL kernels (no JAX import): select+push and the exchange merge.

Importing this package does not import the CuTe DSL: the launcher side only
needs :func:`load_kernels` (prebuilt cubins + metadata, see ``cache``); the
kernel sources (``common``, ``select_push``, ``merge``) are compiled on a
machine with nvidia-cutlass-dsl (``python -m jax_dsa_exchange.build``).
(``jax_dsa_exchange.testing.sim`` runs W ranks on one GPU through CuPy: tests, benchmarks.)
"""

from .cache import KernelImage, load_kernels  # noqa: F401
