"""jax-dsa-exchange: exact top-K merge of DSA candidates across the GPUs of one node.

``from jax_dsa_exchange import topk_exchange_merge, Exchange, MergeOutput``.  Importing
the package imports nothing else (no JAX): each name loads its module on first use.
"""

__all__ = ["topk_exchange_merge", "Exchange", "MergeOutput"]

_HOME = {"topk_exchange_merge": "op", "Exchange": "exchange", "MergeOutput": "output"}


def __getattr__(name):
    if name in _HOME:
        import importlib

        value = getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
