"""What the engine launches on a GPU: the numbers behind the Triton launchers' constexpr choices.

A launcher derives each constexpr from the shapes it is given and the numbers here.
"""

from __future__ import annotations

# Paged attention: a prefill query block holds this many rows (tokens x GQA heads); tl.dot
# needs every dimension to be at least DOT_MIN, so decode blocks and small heads are padded.
ATTENTION_ROWS = 64
DOT_MIN = 16
ATTENTION_NUM_WARPS = 4
ATTENTION_NUM_STAGES = 3
# Split-K: at most this many KV splits per (query block, kv head).
MAX_SPLITS = 32
# V2 input preparation: tokens and block-table entries per loop step.
PREPARE_BLOCK = 128
# Sampling: a program holds BLOCK_B x BLOCK_V = SAMPLING_TILE logits at once.
SAMPLING_TILE = 4096


def attention_block_n(head_size: int) -> int:
    """Keys per attention tile: a [BLOCK_N, head] tile of K and one of V stay in registers."""
    return 64 if head_size <= 128 else 32


def rms_norm_num_warps(block: int) -> int:
    return 8 if block >= 4096 else 4
