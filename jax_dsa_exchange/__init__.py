"""jax-dsa-exchange: exact top-K merge of DSA candidates across the GPUs of one node."""
