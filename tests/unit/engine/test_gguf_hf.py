"""A tiny random Llama written as a GGUF file here, the way llama.cpp's convert_hf_to_gguf
writes one (q/k rows permuted for its rotary layout, a byte-level BPE vocabulary in the
metadata), loaded by HF transformers and by pdserve: greedy tokens equal, in float32, on the
blocks (`quantization="gguf"`) and dequantized. The bundled SmolLM2 covers Q4_1 alone
(test_gguf_blocks.py); these files cover Q4_0, Q4_1 and Q8_0, a tied and an untied LM head,
grouped-query attention, and a file no other tool wrote."""

from __future__ import annotations

import functools
import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType, TokenType
from gguf.quants import dequantize, quantize

from pdserve import LLM, SamplingParams
from pdserve.kernels.quant_linear import QTYPES, GGUFRows, QuantWeight
from pdserve.models.loader.gguf import load_tokenizer
from tests.unit.engine.test_gguf_blocks import needs_vnni
from tests.utils.tiny_models import (
    BOS_TOKEN_ID,
    EOS_TOKEN_ID,
    PAD_TOKEN_ID,
    VOCAB_SIZE,
    hf_greedy,
    load_hf_model,
    make_tokenizer,
)

HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS = 64, 128, 2, 4, 2
HEAD_DIM = HIDDEN // HEADS
F32, Q8_0 = GGMLQuantizationType.F32, GGMLQuantizationType.Q8_0
# The projections' format -> (token_embd's format, output's: None ties it to token_embd). The
# untied heads keep their own blocks for the LM head's matmul, the tied one the embedding's.
FORMATS = {
    "Q4_0": (F32, GGMLQuantizationType.Q4_0),
    "Q4_1": (Q8_0, GGMLQuantizationType.Q4_1),
    "Q8_0": (Q8_0, None),
}
_FILE_TYPES = {"Q4_0": LlamaFileType.MOSTLY_Q4_0, "Q4_1": LlamaFileType.MOSTLY_Q4_1,
               "Q8_0": LlamaFileType.MOSTLY_Q8_0}  # fmt: skip
MAX_TOKENS = 16
PROMPT_LENS = (5, 17, 30)  # within a KV block, across one, across two


def _llama_cpp_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute: per head, the rotary halves' rows interleaved."""
    return (
        weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def _random_weights(seed: int) -> dict[str, np.ndarray]:
    """HF-named [out, in] weights, spread as tests/utils/tiny_models.py spreads them, so that
    greedy argmax has clear margins."""
    rng = np.random.default_rng(seed)
    shapes = {"model.embed_tokens.weight": (VOCAB_SIZE, HIDDEN), "lm_head.weight": (VOCAB_SIZE, HIDDEN),
              "model.norm.weight": (HIDDEN,)}  # fmt: skip
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        shapes |= {
            f"{p}.input_layernorm.weight": (HIDDEN,),
            f"{p}.post_attention_layernorm.weight": (HIDDEN,),
            f"{p}.self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
            f"{p}.self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            f"{p}.self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            f"{p}.self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
            f"{p}.mlp.gate_proj.weight": (INTERMEDIATE, HIDDEN),
            f"{p}.mlp.up_proj.weight": (INTERMEDIATE, HIDDEN),
            f"{p}.mlp.down_proj.weight": (HIDDEN, INTERMEDIATE),
        }
    weights = {}
    for name, shape in shapes.items():
        noise = rng.standard_normal(shape, dtype=np.float32)
        weights[name] = 1.0 + 0.2 * noise if len(shape) == 1 else noise * (2 / math.sqrt(shape[1]))
    return weights


def _gguf_tensors(fmt: str, seed: int) -> dict[str, tuple[np.ndarray, GGMLQuantizationType]]:
    """llama.cpp's names, its q/k row order, each tensor in its stored format."""
    embd_type, output_type = FORMATS[fmt]
    proj_type = GGMLQuantizationType[fmt]
    w = _random_weights(seed)
    tensors = {"token_embd.weight": (w["model.embed_tokens.weight"], embd_type),
               "output_norm.weight": (w["model.norm.weight"], F32)}  # fmt: skip
    if output_type is not None:
        tensors["output.weight"] = (w["lm_head.weight"], output_type)
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        q = _llama_cpp_permute(w[f"{p}.self_attn.q_proj.weight"], HEADS)
        k = _llama_cpp_permute(w[f"{p}.self_attn.k_proj.weight"], KV_HEADS)
        tensors |= {
            f"blk.{i}.attn_norm.weight": (w[f"{p}.input_layernorm.weight"], F32),
            f"blk.{i}.ffn_norm.weight": (w[f"{p}.post_attention_layernorm.weight"], F32),
            f"blk.{i}.attn_q.weight": (q, proj_type),
            f"blk.{i}.attn_k.weight": (k, proj_type),
            f"blk.{i}.attn_v.weight": (w[f"{p}.self_attn.v_proj.weight"], proj_type),
            f"blk.{i}.attn_output.weight": (w[f"{p}.self_attn.o_proj.weight"], proj_type),
            f"blk.{i}.ffn_gate.weight": (w[f"{p}.mlp.gate_proj.weight"], proj_type),
            f"blk.{i}.ffn_up.weight": (w[f"{p}.mlp.up_proj.weight"], proj_type),
            f"blk.{i}.ffn_down.weight": (w[f"{p}.mlp.down_proj.weight"], proj_type),
        }
    return tensors


@functools.cache
def _source_tokenizer():
    return make_tokenizer(VOCAB_SIZE)


def _add_tokenizer(writer: GGUFWriter) -> None:
    """The tiny models' byte-level BPE as llama.cpp stores a 'gpt2' vocabulary: tokens already in
    the byte alphabet, merges as "a b", the special tokens marked CONTROL (so that both
    tokenizers keep them whole)."""
    source = _source_tokenizer()
    model = json.loads(source.backend_tokenizer.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].__getitem__)
    assert len(tokens) == VOCAB_SIZE
    special = {PAD_TOKEN_ID, BOS_TOKEN_ID, EOS_TOKEN_ID}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([TokenType.CONTROL if i in special else TokenType.NORMAL
                            for i in range(len(tokens))])  # fmt: skip
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in model["merges"]])
    writer.add_bos_token_id(BOS_TOKEN_ID)
    writer.add_eos_token_id(EOS_TOKEN_ID)
    writer.add_pad_token_id(PAD_TOKEN_ID)
    writer.add_add_bos_token(False)
    writer.add_chat_template(source.chat_template)


def write_tiny_llama_gguf(path: Path, fmt: str, seed: int = 0) -> Path:
    """A tiny random Llama GGUF at `path` with its projections in `fmt` (Q4_0, Q4_1, Q8_0) and
    convert_hf_to_gguf's metadata for a llama model."""
    writer = GGUFWriter(path, "llama")
    writer.add_name("tiny-llama")
    writer.add_context_length(1024)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB_SIZE)
    writer.add_file_type(_FILE_TYPES[fmt])
    _add_tokenizer(writer)
    for name, (weights, qtype) in _gguf_tensors(fmt, seed).items():
        writer.add_tensor(name, quantize(weights, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module", params=list(FORMATS))
def tiny_gguf(request, tmp_path_factory) -> tuple[str, str, list[list[int]], list[list[int]]]:
    """(format, path, prompts as token ids, HF transformers' greedy tokens), one file a format."""
    fmt = request.param
    path = write_tiny_llama_gguf(tmp_path_factory.mktemp("gguf") / f"tiny-{fmt}.gguf", fmt)
    rng = random.Random(1234)
    prompts = [[rng.randrange(3, VOCAB_SIZE) for _ in range(n)] for n in PROMPT_LENS]
    return fmt, str(path), prompts, hf_greedy(path, prompts, MAX_TOKENS)


def test_the_file_is_in_llama_cpp_layout(tiny_gguf) -> None:
    """Both readers undo the same q/k permutation, so the tokens alone would not notice a file
    written without it: transformers, which follows llama.cpp, gets back each projection as it
    was before permuting, up to the quantization's rounding. And the vocabulary in the metadata
    tokenizes as the tokenizer it was written from."""
    fmt, path, _, _ = tiny_gguf
    text = "<|im_start|>The capital of France is Paris.<|im_end|>"
    tokenizer, source = load_tokenizer(Path(path)), _source_tokenizer()
    assert tokenizer(text).input_ids == source(text).input_ids
    assert tokenizer.eos_token_id == EOS_TOKEN_ID
    assert tokenizer.chat_template == source.chat_template
    qtype = GGMLQuantizationType[fmt]
    state = load_hf_model(Path(path)).state_dict()
    for name, weights in _random_weights(seed=0).items():
        if name.endswith("_proj.weight"):  # row blocks: quantizing commutes with permuting rows
            expected = dequantize(quantize(weights, qtype), qtype)
            np.testing.assert_array_equal(state[name].numpy(), expected, err_msg=name)


def _pdserve_greedy(
    path: str, prompts: list[list[int]], quantization: str, fmt: str, kept: type = QuantWeight
) -> list[list[int]]:
    """Greedy tokens; on blocks, `kept` holds them: QuantWeight for the CPU kernel, GGUFRows
    for the Triton kernel."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(model=path, quantization=quantization, dtype="float32", max_model_len=256) as llm:
        model = llm.engine_core.executor.worker.model_runner.model
        qkv = model.model.layers[0].self_attn.qkv_proj.packed_weight
        head = model.lm_head.packed_weight
        if quantization == "gguf":
            head_format = (FORMATS[fmt][1] or FORMATS[fmt][0]).name
            assert isinstance(qkv, kept) and qkv.qtype == QTYPES[fmt]
            assert isinstance(head, kept) and head.qtype == QTYPES[head_format]
        else:
            assert not isinstance(qkv, QuantWeight) and not isinstance(head, QuantWeight)
        prompts = [{"prompt_token_ids": p} for p in prompts]
        outputs = llm.generate(prompts, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


# The dequantized path runs on any CPU; only the blocks need the kernel's instructions.
@pytest.mark.parametrize("quantization", [pytest.param("gguf", marks=needs_vnni), "none"])
def test_tiny_gguf_greedy_matches_transformers(tiny_gguf, quantization) -> None:
    fmt, path, prompts, expected = tiny_gguf
    assert _pdserve_greedy(path, prompts, quantization, fmt) == expected


# The tied head (the embedding's blocks moved to the device) in the default suite; 14 s each.
@pytest.mark.parametrize(
    "tiny_gguf",
    [
        "Q8_0",
        pytest.param("Q4_0", marks=pytest.mark.slow),
        pytest.param("Q4_1", marks=pytest.mark.slow),
    ],
    indirect=True,
)
def test_tiny_gguf_on_the_triton_kernel_matches_transformers(tiny_gguf, monkeypatch) -> None:
    """The Triton backend (CUDA's, forced here: the interpreter without a GPU) keeps the blocks
    as the file stores them for the Triton dequantize-matmul, and needs no CPU kernel."""
    monkeypatch.setenv("PDSERVE_KERNEL_BACKEND", "triton")
    monkeypatch.setattr("pdserve.kernels.quant_linear.available", lambda: False)
    fmt, path, prompts, expected = tiny_gguf
    assert _pdserve_greedy(path, prompts, "gguf", fmt, kept=GGUFRows) == expected
