"""Loading checkpoint tensors into a model's parameters, by HF checkpoint name.

Parameters that pack several checkpoint tensors (qkv_proj, gate_up_proj, the experts' w13/w2)
carry a `weight_loader(param, tensor, shard_id[, expert_id])` that places one tensor, and this
rank's shard of it; every other parameter copies the tensor whole.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import nn

# A checkpoint expert tensor: "...experts.<expert id>.<projection name>.weight".
_EXPERT_WEIGHT = re.compile(r"\.experts\.(\d+)\.(\w+)\.weight$")
# Buffers some checkpoints carry that pdserve recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(
            f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit the parameter's "
            f"shape {tuple(param.shape)}"
        )
    param.data.copy_(loaded)


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
    loaded: set[str] = set()
    for name, tensor in weights:
        if name in ignored or name.endswith(_IGNORED_SUFFIXES):
            continue
        param_name, args = _locate(name, stacked_params, expert_params or {})
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
