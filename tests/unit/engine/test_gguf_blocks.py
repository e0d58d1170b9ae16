"""`--quantization gguf`: the default model's projections kept in their GGUF blocks (Q4_1), and
its LM head (Q8_0), read by the CPU kernel (kernels/quant_linear.py). In float32 the kernel forms the dequantized
path's products in its order, so the tokens and logprobs are the dequantized path's, bit for
bit (and so HF's: tests/unit/models/test_loader.py); in bf16 the activations are quantized to
int8 per block and the model still answers. Where the blocks cannot go, an error names it.
Over worker processes: tests/distributed/test_gguf_parallel.py."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from pdserve import LLM, SamplingParams
from pdserve.config import EngineConfig
from pdserve.kernels.cpu import native
from pdserve.kernels.quant_linear import QTYPES, QuantWeight, pack, quant_linear
from pdserve.models.layers import vocab_parallel_embedding
from pdserve.models.loader.gguf import _kept_projections, _split_by_tp

needs_vnni = pytest.mark.skipif(
    not native.compiler_available()
    or not (native.cpu_has("avx512_vnni") and native.cpu_has("avx512_bf16")),
    reason="no C++ compiler, or a CPU without AVX-512 VNNI and BF16",
)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


def _greedy(quantization: str, dtype: str) -> list[tuple[list[int], dict[int, float]]]:
    """Each prompt's greedy tokens and the logprobs of its first token's top 5."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
    with LLM(dtype=dtype, quantization=quantization, max_model_len=256) as llm:
        runner = llm.engine_core.executor.worker.model_runner
        qkv = runner.model.model.layers[0].self_attn.qkv_proj.packed_weight
        assert isinstance(qkv, QuantWeight) is (quantization == "gguf")
        head = runner.model.lm_head.packed_weight  # the tied embedding, Q8_0
        assert isinstance(head, QuantWeight) is (quantization == "gguf")
        if quantization == "gguf":
            assert (qkv.qtype, head.qtype) == (QTYPES["Q4_1"], QTYPES["Q8_0"])
        outputs = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    return [
        (list(o.token_ids), {t: lp.logprob for t, lp in o.logprobs[0].items()}) for o in outputs
    ]


@needs_vnni
def test_float32_blocks_give_the_dequantized_bits() -> None:
    assert _greedy("gguf", "float32") == _greedy("none", "float32")


@needs_vnni
def test_bf16_blocks_stay_near_the_dequantized_logprobs() -> None:
    """int8 activations move the logits a little: the dequantized path's first token stays in
    the top 5, its logprob within 0.5 (0.12 at most over 20 everyday chats, docs/quantization.md)."""
    for (_, want), (_, got) in zip(_greedy("none", "bfloat16"), _greedy("gguf", "bfloat16")):
        top = max(want, key=want.__getitem__)
        assert top in got and abs(got[top] - want[top]) < 0.5


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"quantization": "awq"}, "quantization must be one of 'gguf', 'none', got 'awq'"),
        ({"quantization": "gguf", "model": "tiny"}, "keeps a .gguf file's blocks; .* is an HF"),
    ],
)
def test_where_blocks_cannot_go_is_named(tiny_model, args, message) -> None:
    if args.get("model") == "tiny":
        args = {**args, "model": tiny_model("llama")}
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_engine_args(**args)


@pytest.mark.parametrize(
    ("args", "implied"),
    [
        pytest.param({}, "gguf", marks=needs_vnni),
        pytest.param({"tensor_parallel_size": 3}, "gguf", marks=needs_vnni),
        pytest.param({"pipeline_parallel_size": 2}, "gguf", marks=needs_vnni),
        ({"device": "cuda"}, "gguf"),  # the Triton dequantize-matmul's blocks
    ],
)
def test_unset_serves_the_blocks_where_they_run(args, implied) -> None:
    """vLLM's rule, a GGUF file implies gguf, where pdserve's blocks run; else dequantized."""
    config = EngineConfig.from_engine_args(**args)
    assert config.model_config.quantization == implied


@pytest.mark.parametrize(
    ("device", "missing", "message"),
    [
        ("cpu", "pdserve.kernels.quant_linear.available", "needs the CPU kernel of kernels/"),
        (
            "cuda",
            "pdserve.kernels.backend.HAS_TRITON",
            "on cuda needs the Triton dequantize-matmul",
        ),
    ],
)
def test_without_the_kernel_that_reads_them_blocks_are_named(monkeypatch, device, missing, message):
    """The device picks the kernel: on CPU quant_linear.py's (AVX-512 VNNI and BF16), on CUDA
    the Triton dequantize-matmul. Without it `gguf` is refused by name; unset dequantizes."""
    monkeypatch.setattr(missing, (lambda: False) if device == "cpu" else False)
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_engine_args(quantization="gguf", device=device)
    assert EngineConfig.from_engine_args(device=device).model_config.quantization == "none"


def test_a_row_parallel_share_that_would_split_blocks_is_dequantized(caplog) -> None:
    """o_proj and down_proj shard along K, by each row's bytes: whole blocks only where a rank's
    share of K is whole blocks of its format (Q4_K's of 256). q/k/v shard by rows."""
    q4_0, q4_k = QTYPES["Q4_0"], QTYPES["Q4_K"]
    tensors = {
        "blk.0.attn_q.weight": (q4_0, 48),  # any K: its rows split, whole
        "blk.0.attn_output.weight": (q4_0, 576),  # the default model's: 18 blocks
        "blk.0.ffn_down.weight": (q4_k, 11008),  # Llama 2 7B's: 43 super-blocks
    }
    assert _split_by_tp(tensors, 1) == set()
    assert _split_by_tp(tensors, 2) == {"blk.0.ffn_down.weight"}  # 21.5 super-blocks a rank
    with caplog.at_level(logging.INFO, logger="pdserve.models.loader.gguf"):
        assert _split_by_tp(tensors, 4) == {"blk.0.attn_output.weight", "blk.0.ffn_down.weight"}
    assert "o_proj's 576 input features in Q4_0 blocks of 32" in caplog.text
    assert "down_proj's 11008 input features in Q4_K blocks of 256" in caplog.text


@needs_vnni
@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q8_0"])  # gguf cannot quantize to Q4_K
def test_the_last_ranks_head_pads_its_blocks_with_zero_weights(monkeypatch, fmt) -> None:
    """A vocabulary of 5 over 2 ranks: rank 1 holds rows 3 and 4 and one of padding, in blocks
    as in the dense weight, so that every rank's logits have the gather's width."""
    monkeypatch.setattr(vocab_parallel_embedding, "get_tensor_model_parallel_rank", lambda: 1)
    monkeypatch.setattr(vocab_parallel_embedding, "get_tensor_model_parallel_world_size", lambda: 2)
    head = vocab_parallel_embedding.ParallelLMHead(5, 64, torch.float32)
    qtype = GGMLQuantizationType[fmt]
    raw = quantize(np.random.default_rng(0).standard_normal((5, 64), dtype=np.float32), qtype)
    loaded = torch.from_numpy(dequantize(raw, qtype))
    loaded.gguf_blocks = (torch.from_numpy(raw), QTYPES[fmt])
    head.weight.weight_loader(head.weight, loaded)
    rows, _ = head.gguf_blocks
    packed = pack(rows.numpy(), QTYPES[fmt], rows.shape[0], 64)
    # x = I reads the weights back exactly: one product a sum, the rest zeros.
    assert torch.equal(quant_linear(torch.eye(64), packed, None).T, head.weight)
    assert torch.equal(head.weight[2], torch.zeros(64))


def test_a_merged_projection_stays_in_blocks_only_in_one_format() -> None:
    """q/k/v and gate/up load into one matmul each: a group of mixed formats (llama.cpp's
    K-quant mixes) or one outside the kernel's is dequantized whole."""
    q4_1, q8_0, q6_k = QTYPES["Q4_1"], QTYPES["Q8_0"], 14
    types = {
        **{f"blk.0.attn_{k}.weight": t for k, t in (("q", q4_1), ("k", q4_1), ("v", q8_0))},
        "blk.0.attn_output.weight": q4_1,
        "blk.0.ffn_gate.weight": q8_0,
        "blk.0.ffn_up.weight": q8_0,
        "blk.0.ffn_down.weight": q6_k,
        "blk.0.attn_norm.weight": 0,
    }
    kept = _kept_projections(types, tuple(QTYPES.values()))
    assert kept == {"blk.0.attn_output.weight", "blk.0.ffn_gate.weight", "blk.0.ffn_up.weight"}
