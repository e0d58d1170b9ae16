"""An fp8 KV cache's per-layer scales, calculated once at start (--calculate-kv-scales).

vLLM calculates them from the first real batch, so its scales (and every later answer) depend on
which requests came first. pdserve runs a fixed text through the model instead, into a cache of
the model's own dtype, and takes each layer's largest key and value: the same scales on every
start, on both sides of a split (the handshake compares the setting). A scale is amax over
vLLM's constants (its K_SCALE_CONSTANT and V_SCALE_CONSTANT): headroom for values the text did
not reach, which are stored saturated.
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.kernels.attention import AttentionMetadata
from pdserve.kernels.kv_cache import KVScale
from pdserve.models.layers.attention import Attention
from pdserve.utils import cdiv

K_SCALE_CONSTANT, V_SCALE_CONSTANT = 200.0, 100.0
CALIBRATION_TEXT = (
    "The committee met on Tuesday to review the budget. After a long discussion, members agreed "
    "to fund the new library, repair two bridges and hire 14 teachers. def mean(xs): return "
    "sum(xs) / len(xs)  # average of a list. Q: What is 17 * 23? A: 391. The weather in Paris "
    "was mild, 18 °C, with light rain in the evening; tomorrow: sunny. «Bonjour», dit-elle."
)
_BLOCK = 16


@torch.inference_mode()
def calculate_kv_scales(
    model: nn.Module, token_ids: list[int], dtype: torch.dtype, device: torch.device
) -> list[KVScale]:
    """Each attention layer's (k_scale, v_scale) from one prefill of `token_ids`, set on the
    layers and returned in the model's order; a layer that stored only zeros keeps 1.0."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    n = len(token_ids)
    num_blocks = cdiv(n, _BLOCK) + 1  # block 0 stays the null block, as in the engine
    heads, dim = layers[0].num_kv_heads, layers[0].head_dim
    cache = torch.zeros(num_blocks, len(layers), 2, _BLOCK, heads, dim, dtype=dtype, device=device)
    md = AttentionMetadata(
        num_reqs=1,
        num_actual_tokens=n,
        max_query_len=n,
        max_seq_len=n,
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([n], dtype=torch.int32, device=device),
        block_table=torch.arange(1, num_blocks, dtype=torch.int32, device=device)[None],
        slot_mapping=torch.arange(_BLOCK, _BLOCK + n, dtype=torch.int64, device=device),
    )
    ids = torch.tensor(token_ids, dtype=torch.int64, device=device)
    model(ids, torch.arange(n, device=device), [cache[:, i] for i in range(len(layers))], md)
    amax = cache[1:].abs().float().amax(dim=(0, 3, 4, 5))  # [layers, 2]
    scales = []
    for k, v in amax.tolist():
        # Rounded to float32 here: the kernels store with that value's reciprocal.
        scale = (k / K_SCALE_CONSTANT if k else 1.0, v / V_SCALE_CONSTANT if v else 1.0)
        scales.append(tuple(float(torch.tensor(s, dtype=torch.float32)) for s in scale))
    for layer, scale in zip(layers, scales, strict=True):
        layer.kv_scale = scale
    return scales
