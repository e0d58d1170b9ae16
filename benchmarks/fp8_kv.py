"""The fp8 KV cache (--kv-cache-dtype) against the bf16 one on the default model, on CPU.

1. Attention: a decode step's attention at --batch sequences of --context tokens, every layer of
   the default model (SmolLM2-135M: 30 layers, 9 query heads over 3 KV heads of 64), each layer's
   blocks its own memory (the whole cache read once, as in a step), bf16 and fp8 caches timed
   alternately over --rounds rounds in one process (`paged_attention_cpu`, the kernel the decoder
   stack runs). Prints each cache's median time, the bytes it reads, the achieved GB/s and the
   ratio fp8 / bf16.
2. Agreement: benchmarks/hf_agreement.py's everyday chats, greedy, --max-tokens tokens, the
   engine's default settings with a bf16 cache and with each fp8 format: how many first tokens
   and whole answers agree, the tokens before the first divergence, and the largest difference
   of the first token's logprob where it agrees.

Usage: .venv/bin/python benchmarks/fp8_kv.py [--batch 64] [--context 1024] [--rounds 5]
       [--max-tokens 32] [--part attention|agreement|both]
Prints tables and a final JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_agreement import PROMPTS  # noqa: E402

from pdserve import LLM, SamplingParams  # noqa: E402
from pdserve.config import ModelConfig  # noqa: E402
from pdserve.kernels.attention import AttentionMetadata, paged_attention_cpu  # noqa: E402

CACHES = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
BLOCK = 16


def attention_step(batch: int, context: int, rounds: int) -> dict[str, dict[str, float]]:
    geometry = ModelConfig().kv_cache_geometry
    layers, kv_heads, dim = geometry.num_layers, geometry.num_kv_heads, geometry.head_dim
    heads = kv_heads * 3
    per_seq = -(-context // BLOCK)
    num_blocks = batch * per_seq + 1
    gen = torch.Generator().manual_seed(0)
    table = (torch.randperm(num_blocks - 1, generator=gen) + 1).int().view(batch, per_seq)
    md = AttentionMetadata(
        num_reqs=batch,
        num_actual_tokens=batch,
        max_query_len=1,
        max_seq_len=context,
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32),
        seq_lens=torch.full((batch,), context, dtype=torch.int32),
        block_table=table,
        slot_mapping=torch.zeros(batch, dtype=torch.int64),
    )
    query = torch.randn(batch, heads, dim, generator=gen).bfloat16()
    shape = (num_blocks, layers, 2, BLOCK, kv_heads, dim)
    caches = {}
    for name, dtype in CACHES.items():
        caches[name] = (torch.randn(shape, generator=gen) * 2).to(dtype)
    times: dict[str, list[float]] = {name: [] for name in CACHES}
    for _ in range(rounds + 1):  # the first round warms up (kernel builds, page faults)
        for name, cache in caches.items():
            start = time.perf_counter()
            for layer in range(layers):
                out = paged_attention_cpu(query, cache[:, layer], md, dim**-0.5)
                assert out is not None, f"{name}: the native kernel did not run"
            times[name].append(time.perf_counter() - start)
    results = {}
    for name, cache in caches.items():
        seconds = statistics.median(times[name][1:])
        read = batch * context * layers * 2 * kv_heads * dim * cache.element_size()
        results[name] = {"ms": seconds * 1e3, "MB": read / 1e6, "GB/s": read / seconds / 1e9}
    base = results["bf16"]["ms"]
    for name in CACHES:
        results[name]["ratio"] = results[name]["ms"] / base
    print(f"\nattention, a decode step: batch {batch}, context {context}, {layers} layers")
    print(f"{'cache':<10} {'ms':>8} {'MB read':>8} {'GB/s':>6} {'vs bf16':>8}")
    for name, r in results.items():
        print(f"{name:<10} {r['ms']:8.2f} {r['MB']:8.1f} {r['GB/s']:6.1f} {r['ratio']:8.2f}")
    return results


def answers(kv_cache_dtype: str, max_tokens: int) -> list:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=1)
    with LLM(max_model_len=1024, kv_cache_dtype=kv_cache_dtype) as llm:
        chats = [[{"role": "user", "content": p}] for p in PROMPTS]
        return [o.outputs[0] for o in llm.chat(chats, params, use_tqdm=False)]


def agreement(max_tokens: int) -> dict[str, dict[str, float]]:
    reference = answers("auto", max_tokens)
    results = {}
    for kv in ("fp8", "fp8_e5m2"):
        got = answers(kv, max_tokens)
        first = same = before = 0
        drift = 0.0
        for a, b in zip(reference, got, strict=True):
            n = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
            before += len(a.token_ids) if n is None else n
            same += a.token_ids == b.token_ids
            if a.token_ids[0] == b.token_ids[0]:
                first += 1
                t = a.token_ids[0]
                drift = max(drift, abs(a.logprobs[0][t].logprob - b.logprobs[0][t].logprob))
        results[kv] = {
            "first": first,
            "identical": same,
            "tokens_before_divergence": before,
            "max_first_logprob_diff": drift,
        }
    n, total = len(PROMPTS), sum(len(a.token_ids) for a in reference)
    print(f"\nagreement with the bf16 cache: {n} chats, {max_tokens} greedy tokens")
    for kv, r in results.items():
        print(
            f"{kv:<9} first token {r['first']}/{n}, identical {r['identical']}/{n}, "
            f"{r['tokens_before_divergence']}/{total} tokens before the first divergence, "
            f"first-token logprob within {r['max_first_logprob_diff']:.3f}"
        )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--part", choices=("attention", "agreement", "both"), default="both")
    args = parser.parse_args()
    report = {}
    if args.part in ("attention", "both"):
        report["attention"] = attention_step(args.batch, args.context, args.rounds)
    if args.part in ("agreement", "both"):
        report["agreement"] = agreement(args.max_tokens)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
