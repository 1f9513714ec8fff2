"""Custom operators that zoo's rewrites put into programs, each with its Triton kernel for the GPU and torch's
own computation elsewhere. Importing the package registers them: a saved program that calls one can only be
loaded (``torch.export.load``) once it is registered, which is why ``zoo.contract.run_folder`` imports it.

- ``split_kv_attention``: ``zoo::split_kv_attention``, attention over a long, masked KV pool for few queries
  (``zoo.rewrites.split_kv_attention`` puts it in place of ``scaled_dot_product_attention``).

Why a package of its own, beside ``core``: the deploy side loads rewritten programs (the runner's eager
backend) and must not import the exporter's rewrites, while the rewrites must create the op; both import it
from here, and it imports no other part of zoo.
"""

from __future__ import annotations

import torch

from zoo.kernels.split_kv_attention import NAME as SPLIT_KV_ATTENTION_NAME
from zoo.kernels.split_kv_attention import KERNEL_DTYPES, kernel_declines, runs_kernel

SPLIT_KV_ATTENTION = torch.ops.zoo.split_kv_attention.default  # registered by the import above

__all__ = ["SPLIT_KV_ATTENTION", "SPLIT_KV_ATTENTION_NAME", "KERNEL_DTYPES", "kernel_declines", "runs_kernel"]
