"""GGUF blocks (`quantization="gguf"`) over worker processes: test_gguf_hf.py's tiny Llama GGUFs
under TP=2, PP=2 and both give HF transformers' greedy tokens in float32, and each rank reads its
share of every projection and of the LM head in blocks. In float32 the block kernel gives the
dequantized path's bits (docs/quantization.md), and a row-parallel share sums in the same
all-reduce, so the tokens are those of TP on dequantized weights too."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from pdserve import LLM, SamplingParams
from pdserve.executor.worker import Worker
from pdserve.kernels.quant_linear import QTYPES, QuantWeight
from tests.unit.engine.test_gguf_blocks import needs_vnni
from tests.unit.engine.test_gguf_hf import (
    FORMATS,
    HEAD_DIM,
    HEADS,
    HIDDEN,
    INTERMEDIATE,
    KV_HEADS,
    LAYERS,
    MAX_TOKENS,
    PROMPT_LENS,
    write_tiny_llama_gguf,
)
from tests.utils.tiny_models import VOCAB_SIZE, hf_greedy

pytestmark = needs_vnni


class BlockReportingWorker(Worker):
    def kept_blocks(self) -> dict[str, list[int]]:
        """Per module whose matmul reads GGUF blocks on this rank: [format, out features, in
        features] of its share."""
        model = self.model_runner.model
        head = getattr(model, "lm_head", None)
        return {
            "lm_head" if module is head else name: [w.qtype, w.out_features, w.in_features]
            for name, module in model.named_modules()
            if isinstance(w := getattr(module, "packed_weight", None), QuantWeight)
        }


def expected_blocks(fmt: str, tp: int, layers: range, last_stage: bool) -> dict[str, list[int]]:
    """A rank's shares: q/k/v and gate/up split by output features, o and down by input
    features, the LM head by vocabulary rows."""
    qtype = QTYPES[fmt]
    blocks = {}
    for i in layers:
        p = f"model.layers.{i}"
        blocks |= {
            f"{p}.self_attn.qkv_proj": [qtype, (HEADS + 2 * KV_HEADS) * HEAD_DIM // tp, HIDDEN],
            f"{p}.self_attn.o_proj": [qtype, HIDDEN, HEADS * HEAD_DIM // tp],
            f"{p}.mlp.gate_up_proj": [qtype, 2 * INTERMEDIATE // tp, HIDDEN],
            f"{p}.mlp.down_proj": [qtype, HIDDEN, INTERMEDIATE // tp],
        }
    if last_stage:
        head_format = (FORMATS[fmt][1] or FORMATS[fmt][0]).name
        blocks["lm_head"] = [QTYPES[head_format], VOCAB_SIZE // tp, HIDDEN]
    return blocks


@pytest.mark.parametrize(
    ("fmt", "tp", "pp"),
    [
        ("Q4_0", 2, 1),  # an untied head: the output tensor's own blocks
        ("Q8_0", 2, 1),  # a tied head: the embedding's blocks
        ("Q8_0", 1, 2),  # the tied embedding looked up on the first stage, matmul on the last
        pytest.param("Q4_1", 2, 1, marks=pytest.mark.slow),
        pytest.param("Q4_0", 2, 2, marks=pytest.mark.slow),
    ],
)
def test_parallel_blocks_match_transformers(tmp_path: Path, fmt: str, tp: int, pp: int) -> None:
    path = write_tiny_llama_gguf(tmp_path / f"tiny-{fmt}.gguf", fmt)
    rng = random.Random(1234)
    prompts = [[rng.randrange(3, VOCAB_SIZE) for _ in range(n)] for n in PROMPT_LENS]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(
        model=str(path),
        quantization="gguf",
        dtype="float32",
        max_model_len=256,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        distributed_executor_backend="mp",
        worker_cls=f"{__name__}:BlockReportingWorker",
    ) as llm:
        assert llm.config.model_config.quantization == "gguf"
        per_rank = llm.engine_core.executor.collective_rpc("kept_blocks")
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    stage_layers = LAYERS // pp
    assert per_rank == [
        expected_blocks(fmt, tp, range(s * stage_layers, (s + 1) * stage_layers), s == pp - 1)
        for s in range(pp)
        for _ in range(tp)
    ]
    assert [list(o.outputs[0].token_ids) for o in outputs] == hf_greedy(path, prompts, MAX_TOKENS)
