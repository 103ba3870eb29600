"""CuTe DSL kernels (no JAX import): the producer (select_push, its lean image) and the exchange
merge.

Importing this package does not import the CuTe DSL: the launcher side only needs
:func:`load_kernels` (prebuilt cubins + metadata, see ``cache``).  The kernel sources are compiled
on a machine with nvidia-cutlass-dsl (``python -m jax_dsa_exchange.build``): ``select`` and
``lean`` (the producer's select), ``select_push`` (the producer: ``ProducerConfig``,
``SelectPush``), ``merge``; ``common`` and ``ptx`` hold the pieces they share.  What varies
between images is a frozen configuration object per kernel; no environment variable changes
kernel code.
"""

from .cache import KernelImage, load_kernels  # noqa: F401
