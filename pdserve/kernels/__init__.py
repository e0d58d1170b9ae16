"""Kernels: each family has a Triton kernel, its torch reference and one dispatch function.

CUDA tensors run Triton, CPU tensors run the torch reference; PDSERVE_KERNEL_BACKEND forces one.
Forcing `triton` without a GPU runs the kernels in Triton's interpreter, which reads
TRITON_INTERPRET when a kernel is decorated: so it is set here, before any kernel module loads.
"""

import os

import torch

from pdserve import envs

if envs.kernel_backend() == "triton" and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
