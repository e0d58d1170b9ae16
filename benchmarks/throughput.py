"""Offline throughput: pdserve vs HF transformers `generate` on the same workload, side by side.

Usage: python benchmarks/throughput.py [--model default|tiny|PATH] [--num-prompts 64]
       [--output-len 128] [--dtype bfloat16] [--hf-batch-size 64]

Both engines get the same prompt token ids and produce exactly `output-len` tokens per prompt
(EOS ignored). Prints a table and a final JSON line.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TOPICS = [
    "the history of Rome",
    "how rainbows form",
    "the rules of chess",
    "why the sky is blue",
    "how to bake bread",
    "the life of bees",
    "the water cycle",
    "how computers add numbers",
    "the planets of the solar system",
    "how to learn a language",
    "the story of the printing press",
    "volcanoes",
    "how vaccines work",
    "the first moon landing",
    "photosynthesis",
    "ocean tides",
]
STYLES = [
    "Explain {t} to a child.",
    "Write a short essay about {t}.",
    "Give me five facts about {t}, each with a sentence of explanation.",
    "Describe {t} in detail, as a teacher would to a class of curious students who ask many questions.",
]


def make_prompts(tokenizer, num_prompts: int) -> list[list[int]]:
    rng = random.Random(0)
    prompts = []
    for i in range(num_prompts):
        text = STYLES[i % len(STYLES)].format(t=TOPICS[rng.randrange(len(TOPICS))])
        prompts.append(tokenizer.encode(text))
    return prompts


def resolve_model(name: str, tmp: Path) -> str:
    if name == "default":
        from pdserve.models.loader import default_model_path

        return str(default_model_path())
    if name == "tiny":
        from tests.utils.tiny_models import make_tiny_model

        return str(make_tiny_model("llama", tmp / "tiny"))
    return name


def run_pdserve(
    model: str, prompts: list[list[int]], output_len: int, dtype: str, tp: int
) -> float:
    from pdserve import LLM, SamplingParams

    llm = LLM(model=model, dtype=dtype, max_model_len=1024, tensor_parallel_size=tp)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=4), use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    llm.shutdown()
    assert all(len(o.outputs[0].token_ids) == output_len for o in outputs)
    return elapsed


@torch.inference_mode()
def run_hf(model, pad_id: int, prompts: list[list[int]], output_len: int, batch_size: int) -> float:
    """HF generate on the model's device (the GPU where pdserve runs on one)."""
    device = next(model.parameters()).device
    model.generate(
        torch.tensor([prompts[0]], device=device),
        max_new_tokens=4,
        do_sample=False,
        pad_token_id=pad_id,
    )
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i : i + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            do_sample=False,
            pad_token_id=pad_id,
        )
        assert out.shape[1] == width + output_len
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="default")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--hf-batch-size", type=int, default=64)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    args = parser.parse_args()

    from pdserve.config import ModelConfig
    from pdserve.models import loader

    with tempfile.TemporaryDirectory() as tmp:
        model = resolve_model(args.model, Path(tmp))
        tokenizer = loader.load_tokenizer(ModelConfig(model=model).source)
        prompts = make_prompts(tokenizer, args.num_prompts)
        total_tokens = args.num_prompts * args.output_len

        pd_time = run_pdserve(
            model, prompts, args.output_len, args.dtype, args.tensor_parallel_size
        )
        gc.collect()
        from tests.utils.tiny_models import load_hf_model

        hf_model = load_hf_model(Path(model), getattr(torch, args.dtype))
        if torch.cuda.is_available():
            hf_model = hf_model.cuda()
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        hf_time = run_hf(hf_model, pad_id, prompts, args.output_len, args.hf_batch_size)

    pd_tps, hf_tps = total_tokens / pd_time, total_tokens / hf_time
    print(f"{'engine':<14}{'seconds':>10}{'output tok/s':>15}")
    print(f"{'pdserve':<14}{pd_time:>10.2f}{pd_tps:>15.1f}")
    print(f"{'hf generate':<14}{hf_time:>10.2f}{hf_tps:>15.1f}")
    print(
        f"ratio pdserve / HF: {pd_tps / hf_tps:.2f}x  ({args.num_prompts} prompts x {args.output_len} tokens, "
        f"{args.model}, {args.dtype}, TP={args.tensor_parallel_size}, HF batch {args.hf_batch_size}, "
        f"{torch.get_num_threads()} threads)"
    )
    print(
        json.dumps(
            {
                "benchmark": "throughput",
                "model": args.model,
                "dtype": args.dtype,
                "num_prompts": args.num_prompts,
                "output_len": args.output_len,
                "pdserve_tok_s": round(pd_tps, 1),
                "hf_tok_s": round(hf_tps, 1),
                "ratio": round(pd_tps / hf_tps, 2),
                "hf_batch_size": args.hf_batch_size,
                "tensor_parallel_size": args.tensor_parallel_size,
            }
        )
    )


if __name__ == "__main__":
    main()
