"""GGUF files (llama.cpp): config and tokenizer from the metadata, weights dequantized or, for
the projections the CPU kernel reads in their blocks, kept as stored.

The file layout is read with transformers' GGUF reader, which skips the vocabulary arrays that
gguf's GGUFReader spends seconds parsing; gguf dequantizes.

Tensors are renamed from llama.cpp's names to HF's, so that models load them with their usual
load_weights; q_proj and k_proj get back the row order that convert_hf_to_gguf permuted for
llama.cpp's rotary layout.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Container, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize
from transformers import (
    LlamaConfig,
    PretrainedConfig,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)
from transformers.integrations.gguf.reader import GgufHeader, read_gguf_metadata

logger = logging.getLogger(__name__)
_SUPPORTED_ARCHITECTURES = ("llama",)
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_VOCAB_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")
# The projections whose weights may stay quantized (their rows are output features), in the
# groups a model merges into one matmul: a group stays in blocks only where its tensors share
# one kept format.
_PROJECTION_GROUPS = (("attn_q", "attn_k", "attn_v"), ("attn_output",), ("ffn_gate", "ffn_up"),
                      ("ffn_down",))  # fmt: skip
# The projections tensor parallelism splits along their input features (K): a rank takes its
# share of each row's bytes, which is whole blocks only where K / TP size is a multiple of the
# format's block (32 weights; Q4_K's super-blocks 256).
_ROW_PARALLEL = ("attn_output", "ffn_down")
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def _metadata(path: Path) -> tuple[dict[str, Any], tuple[str, ...]]:
    """(metadata, tensor names)."""
    return read_gguf_metadata(str(path))


def load_config(path: Path) -> PretrainedConfig:
    meta, tensor_names = _metadata(path)
    arch = meta["general.architecture"]
    if arch not in _SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} of {str(path)!r} is not supported; supported: "
            f"{', '.join(_SUPPORTED_ARCHITECTURES)}."
        )
    num_heads = meta[f"{arch}.attention.head_count"]
    hidden_size = meta[f"{arch}.embedding_length"]
    rope_parameters: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
    }
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling != "none":
        rope_parameters.update(rope_type=scaling, factor=meta[f"{arch}.rope.scaling.factor"])
    return LlamaConfig(
        architectures=["LlamaForCausalLM"],
        # Without an explicit size, the vocabulary array's length (the reader gives the count).
        vocab_size=meta.get(f"{arch}.vocab_size") or meta["tokenizer.ggml.tokens"],
        hidden_size=hidden_size,
        intermediate_size=meta[f"{arch}.feed_forward_length"],
        num_hidden_layers=meta[f"{arch}.block_count"],
        num_attention_heads=num_heads,
        num_key_value_heads=meta.get(f"{arch}.attention.head_count_kv", num_heads),
        head_dim=meta.get(f"{arch}.attention.key_length", hidden_size // num_heads),
        max_position_embeddings=meta[f"{arch}.context_length"],
        rms_norm_eps=meta[f"{arch}.attention.layer_norm_rms_epsilon"],
        rope_parameters=rope_parameters,
        tie_word_embeddings="output.weight" not in tensor_names,
        **load_generation_config(path),
    )


def load_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    # transformers builds the tokenizer, special tokens and chat template from the metadata.
    # Not through AutoTokenizer: it first parses the whole file with GGUFReader just to pick
    # a tokenizer class, which for GGUF is always the tokenizers backend.
    return PreTrainedTokenizerFast.from_pretrained(path.parent, gguf_file=path.name)


def load_generation_config(path: Path) -> dict[str, Any]:
    meta, _ = _metadata(path)
    ids = {
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }
    return {k: v for k, v in ids.items() if v is not None}


def iterate_weights(
    path: Path,
    hf_config: PretrainedConfig,
    keep_quantized: Container[int] = (),
    tp_size: int = 1,
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named float32 tensors, one at a time; the projections' weights of a GGUF type in
    `keep_quantized` as they are stored instead: uint8 rows of blocks (a row per output
    feature), the type in the tensor's `gguf_qtype` attribute (kernels/quant_linear.py), but
    for a row-parallel projection whose blocks `tp_size` ranks would split. An embedding or LM
    head of such a type comes dequantized (the embedding reads rows) with its blocks beside, in
    `gguf_blocks` (rows, type), for the LM head's matmul."""
    header = GgufHeader.from_file(str(path))
    blob = np.memmap(path, mode="r", dtype=np.uint8)
    kept = _kept_projections({t.name: t.ggml_type for t in header.tensors}, keep_quantized)
    shapes = {t.name: (t.ggml_type, t.shape[-1]) for t in header.tensors if t.name in kept}
    kept -= _split_by_tp(shapes, tp_size)
    for info in header.tensors:
        name = _hf_name(info.name, path)
        start = header.data_start + info.offset
        rows = math.prod(info.shape[:-1])
        # One row of blocks per row of the tensor (HF's [out, in] order).
        raw = blob[start : start + info.nbytes].reshape(rows, info.nbytes // rows)
        quantized = info.name in kept
        if quantized:
            weights = np.array(raw)  # a copy: the mmap's pages are read once, here
        else:
            weights = dequantize(raw, GGMLQuantizationType(info.ggml_type)).reshape(info.shape)
        if name.endswith("self_attn.q_proj.weight"):
            weights = _unpermute_rotary(weights, hf_config.num_attention_heads)
        elif name.endswith("self_attn.k_proj.weight"):
            weights = _unpermute_rotary(weights, hf_config.num_key_value_heads)
        if not weights.flags.writeable:  # float32 tensors come back as views of the mmap
            weights = weights.copy()
        tensor = torch.from_numpy(weights)
        if quantized:
            tensor.gguf_qtype = info.ggml_type
        elif info.ggml_type in keep_quantized and name in _VOCAB_TENSORS:
            tensor.gguf_blocks = (torch.from_numpy(np.array(raw)), info.ggml_type)
        yield name, tensor


def _kept_projections(types: dict[str, int], keep_quantized: Container[int]) -> set[str]:
    """The GGUF names of the projections that stay in blocks: each group's tensors of one
    layer in one kept format."""
    kept: set[str] = set()
    for name in types:
        match = _BLOCK_TENSOR.fullmatch(name)
        if match is None or match.group(3) != "weight":
            continue
        layer, kind = match.group(1), match.group(2)
        for group in _PROJECTION_GROUPS:
            if kind in group:
                members = [f"blk.{layer}.{k}.weight" for k in group]
                formats = {types.get(m) for m in members}
                if len(formats) == 1 and formats <= set(keep_quantized):
                    kept.add(name)
    return kept


def _split_by_tp(tensors: dict[str, tuple[int, int]], tp_size: int) -> set[str]:
    """Of `tensors` (GGUF name: format, input features), the row-parallel projections whose
    input features do not split over `tp_size` ranks on their format's block boundaries; logged,
    since they are dequantized."""
    split, reasons = set(), set()
    for name, (qtype, k) in tensors.items():
        match = _BLOCK_TENSOR.fullmatch(name)
        if match is None or match.group(2) not in _ROW_PARALLEL:
            continue
        fmt = GGMLQuantizationType(qtype)
        block = GGML_QUANT_SIZES[fmt][0]
        if k % (tp_size * block):
            split.add(name)
            what = _BLOCK_TENSORS[match.group(2)].rpartition(".")[2]
            reasons.add(f"{what}'s {k} input features in {fmt.name} blocks of {block}")
    if reasons:
        logger.info(
            "Dequantized where %d TP ranks would split their blocks: %s",
            tp_size,
            ", ".join(sorted(reasons)),
        )
    return split


def _hf_name(gguf_name: str, path: Path) -> str:
    base, _, suffix = gguf_name.rpartition(".")
    if base in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[base]}.{suffix}"
    match = _BLOCK_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in _BLOCK_TENSORS:
        raise ValueError(f"GGUF tensor {gguf_name!r} of {str(path)!r} is not supported.")
    layer, kind, suffix = match.groups()
    return f"model.layers.{layer}.{_BLOCK_TENSORS[kind]}.{suffix}"


def _unpermute_rotary(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo convert_hf_to_gguf's permute: per head, llama.cpp interleaves the two rotary halves
    (rows 0, d/2, 1, d/2+1, ...); HF keeps them as two blocks."""
    half = weights.shape[0] // num_heads // 2
    rows = weights.reshape(num_heads, half, 2, *weights.shape[1:])
    return rows.swapaxes(1, 2).reshape(weights.shape)
