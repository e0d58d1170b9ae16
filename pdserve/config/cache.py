"""CacheConfig: the KV cache's blocks, their dtype and the memory they may take."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.config.args import flag
from pdserve.validation import check_choice, check_positive

# vLLM's --kv-cache-dtype values; 'fp8' is e4m3, as vLLM reads it on CUDA.
KV_CACHE_DTYPES = {
    "auto": None,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


@dataclass
class CacheConfig:
    block_size: int = flag(16, "tokens per KV cache block", choices=(1, 2, 4, 8, 16, 32, 64, 128))
    enable_prefix_caching: bool = flag(True, "reuse cached blocks of earlier prompts")
    num_gpu_blocks_override: int | None = flag(
        None, "KV cache blocks, whatever memory says (tests, benchmarks)"
    )
    gpu_memory_utilization: float = flag(
        0.9,
        "CUDA: the fraction of the device's memory this instance may fill, weights and KV "
        "cache together; the KV cache gets what is left of it after loading",
    )
    kv_cache_memory_bytes: int | None = flag(
        None,
        "the KV cache's size per worker in bytes, on any device (overrides "
        "--gpu-memory-utilization; on CPU the default is PDSERVE_CPU_KVCACHE_SPACE GiB, as "
        "vLLM's VLLM_CPU_KVCACHE_SPACE)",
    )

    kv_cache_dtype: str = flag(
        "auto",
        "the KV cache's dtype: 'auto' (the model's), or fp8, half the bytes to store, read and "
        "hand over: 'fp8' (= 'fp8_e4m3'), 'fp8_e5m2' (docs/quantization.md)",
        choices=tuple(KV_CACHE_DTYPES),
    )
    calculate_kv_scales: bool = flag(
        False,
        "an fp8 cache's per-layer key and value scales calculated at start from a fixed text "
        "(vLLM: from the first batch), else 1.0 (docs/quantization.md)",
    )

    def __post_init__(self) -> None:
        check_choice("block_size", self.block_size, (1, 2, 4, 8, 16, 32, 64, 128))
        check_choice("kv_cache_dtype", self.kv_cache_dtype, tuple(KV_CACHE_DTYPES))
        check_positive("num_gpu_blocks_override", self.num_gpu_blocks_override, allow_none=True)
        check_positive("kv_cache_memory_bytes", self.kv_cache_memory_bytes, allow_none=True)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}."
            )
        if self.calculate_kv_scales and self.kv_cache_dtype == "auto":
            raise ValueError(
                "calculate_kv_scales scales an fp8 cache; kv_cache_dtype is 'auto' (set fp8)."
            )
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise ValueError(
                "num_gpu_blocks_override must be at least 2 (one block is the null block), "
                f"got {self.num_gpu_blocks_override}."
            )

    def kv_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The dtype the KV cache's blocks hold."""
        return KV_CACHE_DTYPES[self.kv_cache_dtype] or model_dtype
