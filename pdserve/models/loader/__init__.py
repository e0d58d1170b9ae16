"""Model loading: resolve the source, read its config, tokenizer and generation config, and
build the model with its weights, from an HF folder (safetensors) or a GGUF file."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from pdserve.distributed.parallel_state import get_tensor_model_parallel_world_size
from pdserve.models import registry
from pdserve.models.loader import gguf, hf
from pdserve.models.loader.source import ModelSource, default_model_path, resolve_model_source

logger = logging.getLogger(__name__)

__all__ = [
    "ModelSource",
    "default_model_path",
    "load_generation_config",
    "load_hf_config",
    "load_model",
    "load_tokenizer",
    "resolve_model_source",
]


def load_hf_config(source: ModelSource) -> PretrainedConfig:
    config = gguf.load_config(source.path) if source.kind == "gguf" else hf.load_config(source.path)
    if not getattr(config, "architectures", None):
        raise ValueError(f"The config of {str(source.path)!r} names no architectures.")
    return config


def load_tokenizer(source: ModelSource) -> PreTrainedTokenizerBase:
    if source.kind == "gguf":
        return gguf.load_tokenizer(source.path)
    return hf.load_tokenizer(source.path)


def load_generation_config(source: ModelSource) -> dict[str, Any]:
    if source.kind == "gguf":
        return gguf.load_generation_config(source.path)
    return hf.load_generation_config(source.path)


def load_model(
    hf_config: PretrainedConfig,
    source: ModelSource,
    dtype: torch.dtype,
    device: str | torch.device,
    model_cls: type[nn.Module] | None = None,
    keep_quantized: tuple[int, ...] = (),
) -> nn.Module:
    """The registry's model class for `hf_config` (or `model_cls`: a draft head no one serves
    alone), weights loaded, in eval mode on `device`; a GGUF file's projections of the formats
    in `keep_quantized` stay in their blocks (gguf.iterate_weights)."""
    start = time.perf_counter()
    if model_cls is None:
        model_cls = registry.get_model_class(
            registry.get_model_info(list(hf_config.architectures)).architecture
        )
    # Parameters are created on the device, so weights are copied there once.
    with torch.device(device):
        model = model_cls(hf_config, dtype)
    model.load_weights(_iterate_weights(source, hf_config, keep_quantized))
    # Also moves any buffer a layer built on the CPU.
    model = model.to(device).eval().requires_grad_(False)
    logger.info(
        "Loaded %s (%s) from %s in %.1f s",
        model_cls.__name__,
        dtype,
        source.path,
        time.perf_counter() - start,
    )
    return model


def _iterate_weights(
    source: ModelSource, hf_config: PretrainedConfig, keep_quantized: tuple[int, ...]
) -> Iterator[tuple[str, torch.Tensor]]:
    if source.kind == "gguf":
        tp_size = get_tensor_model_parallel_world_size()
        return gguf.iterate_weights(source.path, hf_config, keep_quantized, tp_size)
    return hf.iterate_weights(source.path)
