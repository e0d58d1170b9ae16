"""Triton kernels (attention, the batch-invariant matmul, sampling), their launch
configurations and their ahead-of-time compile for GPU targets without a GPU."""
