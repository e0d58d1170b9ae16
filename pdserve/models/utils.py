"""What the model families share: their pipeline stages, the geometry of their KV cache, and
loading checkpoint tensors into their parameters by HF checkpoint name.

Under pipeline parallelism a stage builds only its own layers; the others are `PPMissingLayer`s,
whose weights loading skips. Parameters that pack several checkpoint tensors (qkv_proj,
gate_up_proj, the experts' w13/w2) carry a `weight_loader(param, tensor, shard_id[, expert_id])`
that places one tensor, and this rank's shard of it; every other parameter copies the tensor
whole.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig

from pdserve.distributed.parallel_state import (
    IntermediateTensors,
    get_pp_indices,
    get_pp_rank,
    get_pp_world_size,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)
from pdserve.models.layers.attention import Attention

logger = logging.getLogger(__name__)

# A checkpoint expert tensor: "...experts.<expert id>.<projection name>.weight".
_EXPERT_WEIGHT = re.compile(r"\.experts\.(\d+)\.(\w+)\.weight$")
# Buffers some checkpoints carry that pdserve recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


class PPMissingLayer(nn.Identity):
    """The place of a module that another pipeline stage holds: no parameters, no weights."""


def make_layers(
    num_layers: int, make_layer: Callable[[int], nn.Module]
) -> tuple[int, int, nn.ModuleList]:
    """(start, end, layers): this stage's layers [start, end) built, the others missing, so that
    every layer keeps its checkpoint name (model.layers.<i>)."""
    start, end = get_pp_indices(num_layers, get_pp_rank(), get_pp_world_size())
    layers = nn.ModuleList(
        make_layer(i) if start <= i < end else PPMissingLayer() for i in range(num_layers)
    )
    return start, end, layers


@dataclass(frozen=True)
class KVCacheGeometry:
    """What a KV cache holds for a model: one entry per attention layer, each with its KV heads
    of head_dim values (of one pipeline stage and one TP rank, for a model built as one).

    A latent cache (MLA) keeps one part per token, key and value at once, and every TP rank
    holds all of it; otherwise a key part and a value part, each rank its share of the heads."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    latent: bool = False

    @property
    def kv_parts(self) -> int:
        return 1 if self.latent else 2

    def bytes_per_layer_token(self, element_size: int) -> int:
        """What one token's KV costs in one layer (a state model's state rows are this wide
        times the block size: models/state_cache.py)."""
        return self.kv_parts * self.num_kv_heads * self.head_dim * element_size

    def bytes_per_token(self, element_size: int) -> int:
        """What one token's KV costs here, every layer."""
        return self.num_layers * self.bytes_per_layer_token(element_size)


def kv_cache_geometry(model: nn.Module) -> KVCacheGeometry:
    """Read from the model's attention layers: a model family decides which HF config fields it
    uses (OPT ignores num_key_value_heads), so no rule over the config can stand in for it."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    if not layers:  # attention-free (Mamba): no layers, a row of one value per token and part
        return KVCacheGeometry(0, 1, 1)  # to size the state's rows (models/state_cache.py)
    shapes = {(layer.num_kv_heads, layer.head_dim, layer.latent) for layer in layers}
    # One cache tensor holds every layer: a model whose layers differ would need one per layer.
    assert len(shapes) == 1, f"{type(model).__name__}: attention layers of shapes {shapes}"
    ((num_kv_heads, head_dim, latent),) = shapes
    return KVCacheGeometry(len(layers), num_kv_heads, head_dim, latent)


def empty_intermediate_tensors(
    names: Sequence[str],
    num_tokens: int,
    hidden_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> IntermediateTensors:
    """Receive buffers for the activations `names`, each [num_tokens, hidden_size]."""
    return IntermediateTensors(
        {n: torch.empty(num_tokens, hidden_size, dtype=dtype, device=device) for n in names}
    )


def warn_sliding_window(hf_config: PretrainedConfig) -> None:
    # Qwen configs carry a window they only use when use_sliding_window is set.
    if not getattr(hf_config, "use_sliding_window", True):
        return
    window = getattr(hf_config, "sliding_window", None)
    if window and window < hf_config.max_position_embeddings:
        logger.warning(
            "The model uses sliding-window attention (window %d); pdserve attends to the whole "
            "context, so outputs differ from the reference past %d tokens.",
            window,
            window,
        )


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(
            f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit the parameter's "
            f"shape {tuple(param.shape)}"
        )
    param.data.copy_(loaded)


def shard_sections(
    loaded: torch.Tensor, sizes: Sequence[int], rank: int, num_shards: int
) -> torch.Tensor:
    """Of `loaded`'s rows, sections of `sizes` one after another (a fused projection, a
    convolution over its outputs): part `rank` of each section, concatenated."""
    parts = loaded.split(list(sizes), dim=0)
    return torch.cat([shard_tensor(part, 0, rank, num_shards) for part in parts])


def sharded_loader(param: nn.Parameter, sizes: Sequence[int]) -> nn.Parameter:
    """`param` loading this TP rank's part of each section of `sizes` along dim 0."""
    rank, size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    param.weight_loader = lambda p, loaded: default_weight_loader(
        p, shard_sections(loaded, sizes, rank, size)
    )
    return param


def shard_tensor(loaded: torch.Tensor, dim: int, rank: int, num_shards: int) -> torch.Tensor:
    """Part `rank` of `num_shards` equal parts of `loaded` along `dim`."""
    if loaded.dim() <= dim or loaded.shape[dim] % num_shards:
        raise ValueError(
            f"checkpoint tensor of shape {tuple(loaded.shape)} cannot be split in "
            f"{num_shards} parts along dimension {dim}"
        )
    size = loaded.shape[dim] // num_shards
    return loaded.narrow(dim, rank * size, size)


def load_checkpoint_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    *,
    stacked_params: Sequence[tuple[str, str, str | int]] = (),
    expert_params: Mapping[str, tuple[str, str]] | None = None,
    ignored: Iterable[str] = (),
) -> None:
    """Load HF-named `weights` into `model`; every parameter must receive a tensor.

    stacked_params: (param name, checkpoint name, shard id), e.g. ("qkv_proj", "q_proj", "q").
    expert_params: checkpoint projection name -> (param name, shard id) for the tensors of one
        expert, e.g. "gate_proj" -> ("w13_weight", "w1").
    ignored: checkpoint names to skip (e.g. "lm_head.weight" when the embeddings are tied).
    """
    params = dict(model.named_parameters())
    ignored = set(ignored)
    other_stages = tuple(
        f"{name}." for name, module in model.named_modules() if isinstance(module, PPMissingLayer)
    )
    loaded: set[str] = set()
    for name, tensor in weights:
        if name in ignored or name.endswith(_IGNORED_SUFFIXES):
            continue
        param_name, args = _locate(name, stacked_params, expert_params or {})
        if param_name.startswith(other_stages):
            continue
        param = params.get(param_name)
        if param is None:
            raise ValueError(
                f"Checkpoint weight {name!r} has no parameter in {type(model).__name__}."
            )
        weight_loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            weight_loader(param, tensor, *args)
        except ValueError as e:
            raise ValueError(f"Checkpoint weight {name!r}: {e}.") from e
        loaded.add(param_name)
    missing = sorted(set(params) - loaded)
    if missing:
        shown = ", ".join(missing[:8]) + (", ..." if len(missing) > 8 else "")
        raise ValueError(
            f"The checkpoint lacks {len(missing)} weights of {type(model).__name__}: {shown}."
        )


def _locate(
    name: str,
    stacked_params: Sequence[tuple[str, str, str | int]],
    expert_params: Mapping[str, tuple[str, str]],
) -> tuple[str, tuple[str | int, ...]]:
    """The parameter a checkpoint tensor goes to, and the extra weight_loader arguments."""
    match = _EXPERT_WEIGHT.search(name)
    if match is not None and match.group(2) in expert_params:
        param_suffix, shard_id = expert_params[match.group(2)]
        return f"{name[: match.start()]}.experts.{param_suffix}", (shard_id, int(match.group(1)))
    for param_part, weight_part, shard_id in stacked_params:
        if f".{weight_part}." in name:
            return name.replace(f".{weight_part}.", f".{param_part}."), (shard_id,)
    return name, ()
