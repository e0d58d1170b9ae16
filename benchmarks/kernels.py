"""Every Triton kernel against its torch reference: correctness, then time and bandwidth.

Usage: python benchmarks/kernels.py [--peak-bw TB/s] [--small]

On a CUDA device each kernel runs at a serving shape (attention: decode, batch 64, context
4096, head_dim 128, GQA 8:1, bf16), is checked against its reference, and both are timed with
triton.testing.do_bench; bandwidth is the bytes a kernel must move over its time, also as a
fraction of the device's peak (from a table by device name, or --peak-bw). Without a GPU the
kernels run in Triton's interpreter at small shapes, for correctness only. A kernel family
whose module is missing is skipped with a note. Prints a table and a final JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated, at import
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Peak memory bandwidth (TB/s) by a substring of torch.cuda.get_device_name(); first match wins.
PEAK_BW_TBS = [
    ("H200", 4.8),
    ("H100 PCIe", 2.0),
    ("H100", 3.35),
    ("H20", 4.0),
    ("B200", 8.0),
    ("A100-SXM4-80GB", 2.039),
    ("A100 80GB PCIe", 1.935),
    ("A100", 1.555),
    ("L40S", 0.864),
    ("L40", 0.864),
    ("A10", 0.6),
    ("L4", 0.3),
    ("4090", 1.008),
    ("3090", 0.936),
]
DEVICE = torch.device("cuda" if ON_GPU else "cpu")


@dataclass
class Case:
    name: str
    shape: str
    triton: Callable[[], Any]
    torch: Callable[[], Any]
    check: Callable[[], float]  # max abs error of the Triton output; raises when wrong
    bytes: int  # the least a kernel call must move through memory


def _randn(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.randn(*shape, device=DEVICE).to(dtype)


def _err(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float = 0.0) -> float:
    """Max abs error; raises where |actual - expected| > atol + rtol * |expected|."""
    diff = (actual.float() - expected.float()).abs()
    if bool((diff > atol + rtol * expected.float().abs()).any()):
        raise AssertionError(f"max abs error {diff.max().item():.3g} (atol {atol}, rtol {rtol})")
    return diff.max().item() if diff.numel() else 0.0


def _decode_metadata(batch: int, context: int, block_size: int) -> Any:
    from pdserve.kernels.attention import AttentionMetadata

    blocks = context // block_size
    table = torch.randperm(batch * blocks, device=DEVICE).view(batch, blocks).to(torch.int32) + 1
    return AttentionMetadata(
        num_reqs=batch,
        num_actual_tokens=batch,
        max_query_len=1,
        max_seq_len=context,
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.full((batch,), context, dtype=torch.int32, device=DEVICE),
        block_table=table,
        slot_mapping=torch.zeros(batch, dtype=torch.int64, device=DEVICE),
    )


def attention_cases(small: bool) -> list[Case]:
    from pdserve.kernels.attention import paged_attention_torch
    from pdserve.kernels.triton.attention import paged_attention_triton

    batch, context, heads, kv_heads, dim, bs = (
        (2, 32, 4, 1, 32, 16) if small else (64, 4096, 64, 8, 128, 16)
    )
    md = _decode_metadata(batch, context, bs)
    cache = _randn(batch * context // bs + 1, 2, bs, kv_heads, dim)
    query = _randn(batch, heads, dim)
    args = (query, cache, md, dim**-0.5)
    kv_bytes = batch * context * kv_heads * dim * 2 * cache.element_size()
    return [
        Case(
            "attention decode",
            f"B={batch} ctx={context} H={heads}/{kv_heads} d={dim} bf16",
            lambda: paged_attention_triton(*args),
            lambda: paged_attention_torch(*args),
            lambda: _err(paged_attention_triton(*args), paged_attention_torch(*args), 2e-2, 2e-2),
            kv_bytes + 2 * query.numel() * query.element_size(),
        )
    ]


def kv_write_cases(small: bool) -> list[Case]:
    from pdserve.kernels.kv_cache import write_kv_cache_torch, write_kv_cache_triton

    tokens, kv_heads, dim, bs = (10, 2, 32, 4) if small else (8192, 8, 128, 16)
    key, value = _randn(tokens, kv_heads, dim), _randn(tokens, kv_heads, dim)
    slots = torch.randperm(2 * tokens, device=DEVICE)[:tokens]
    caches = [_randn(2 * tokens // bs + 1, 2, bs, kv_heads, dim).zero_() for _ in range(2)]

    def check() -> float:
        write_kv_cache_triton(key, value, caches[0], slots)
        write_kv_cache_torch(key, value, caches[1], slots)
        return _err(caches[0], caches[1], 0.0)

    return [
        Case(
            "kv cache write",
            f"T={tokens} H={kv_heads} d={dim} bf16",
            lambda: write_kv_cache_triton(key, value, caches[0], slots),
            lambda: write_kv_cache_torch(key, value, caches[1], slots),
            check,
            4 * key.numel() * key.element_size(),
        )
    ]


def input_prep_cases(small: bool) -> list[Case]:
    from pdserve.kernels.input_prep import prepare_inputs_torch, prepare_inputs_triton

    rows, max_len, bs = (4, 64, 4) if small else (256, 4096, 16)
    all_ids = torch.randint(0, 32000, (rows, max_len), device=DEVICE)
    computed = torch.randint(1, max_len - 1, (rows,), device=DEVICE)
    table = torch.randint(1, 100000, (rows, max_len // bs), dtype=torch.int32, device=DEVICE)
    idx = torch.randperm(rows, device=DEVICE)
    qsl = torch.arange(rows + 1, dtype=torch.int32, device=DEVICE)
    args = (idx, qsl, rows, all_ids, computed, table, bs)

    def check() -> float:
        out, ref = prepare_inputs_triton(*args), prepare_inputs_torch(*args)
        return max(_err(getattr(out, f), getattr(ref, f), 0.0) for f in vars(ref))

    return [
        Case(
            "input prep (decode)",
            f"reqs={rows} blocks/req={max_len // bs}",
            lambda: prepare_inputs_triton(*args),
            lambda: prepare_inputs_torch(*args),
            check,
            table.numel() * 4 * 2 + rows * 8 * 6,
        )
    ]


def sampling_cases(small: bool) -> list[Case]:
    from pdserve.kernels.sampling import (
        SamplingInputs,
        sample_tokens_torch,
        topk_logprobs_torch,
    )
    from pdserve.kernels.triton.sampling import sample_tokens_triton, topk_logprobs_triton

    rows, vocab = (3, 1000) if small else (64, 128256)
    logits = torch.randn(rows, vocab, device=DEVICE)
    greedy = SamplingInputs(
        temperature=torch.zeros(rows, device=DEVICE),
        all_greedy=True,
        all_random=False,
        top_k=None,
        top_p=None,
        min_p=None,
        seeds=[None] * rows,
        output_positions=[0] * rows,
        output_token_ids=[[] for _ in range(rows)],
        prompt_token_ids=None,
        presence_penalties=None,
        frequency_penalties=None,
        repetition_penalties=None,
    )
    sampled = sample_tokens_torch(logits, greedy)
    nbytes = logits.numel() * logits.element_size()

    def check_logprobs() -> float:
        ids, values, ranks = topk_logprobs_triton(logits, sampled, 5)
        ref_ids, ref_values, ref_ranks = topk_logprobs_torch(logits, sampled, 5)
        _err(ids, ref_ids, 0.0)
        _err(ranks, ref_ranks, 0.0)
        return _err(values, ref_values, 1e-4)

    return [
        Case(
            "sample greedy",
            f"B={rows} V={vocab} fp32",
            lambda: sample_tokens_triton(logits, greedy),
            lambda: sample_tokens_torch(logits, greedy),
            lambda: _err(sample_tokens_triton(logits, greedy), sampled, 0.0),
            nbytes,
        ),
        Case(
            "top-5 logprobs",
            f"B={rows} V={vocab} fp32",
            lambda: topk_logprobs_triton(logits, sampled, 5),
            lambda: topk_logprobs_torch(logits, sampled, 5),
            check_logprobs,
            nbytes,
        ),
    ]


def norm_cases(small: bool) -> list[Case]:
    from pdserve.kernels.norm import fused_add_rms_norm_torch, fused_add_rms_norm_triton

    tokens, hidden = (6, 96) if small else (4096, 4096)
    x, residual, weight = _randn(tokens, hidden), _randn(tokens, hidden), _randn(hidden)
    args = (x, residual, weight, 1e-5)

    def check() -> float:
        out, res = fused_add_rms_norm_triton(*args)
        ref, ref_res = fused_add_rms_norm_torch(*args)
        return max(_err(out, ref, 1e-2, 1.6e-2), _err(res, ref_res, 1e-2, 1.6e-2))

    return [
        Case(
            "fused add + rmsnorm",
            f"T={tokens} hidden={hidden} bf16",
            lambda: fused_add_rms_norm_triton(*args),
            lambda: fused_add_rms_norm_torch(*args),
            check,
            4 * x.numel() * x.element_size(),
        )
    ]


def rotary_cases(small: bool) -> list[Case]:
    from pdserve.kernels.rotary import rotary_embedding_torch, rotary_embedding_triton
    from pdserve.models.layers.rotary_embedding import get_rope

    tokens, heads, kv_heads, dim = (5, 4, 2, 32) if small else (4096, 32, 8, 128)
    with torch.device(DEVICE):
        cache = get_rope(dim, {"rope_theta": 500000.0}, 8192, torch.bfloat16).cos_sin_cache
    q, k = _randn(tokens, heads, dim), _randn(tokens, kv_heads, dim)
    args = (torch.randint(0, 8192, (tokens,), device=DEVICE), q, k, cache)

    def check() -> float:
        (qo, ko), (qr, kr) = rotary_embedding_triton(*args), rotary_embedding_torch(*args)
        return max(_err(qo, qr, 1e-2, 1.6e-2), _err(ko, kr, 1e-2, 1.6e-2))

    return [
        Case(
            "rotary q+k",
            f"T={tokens} H={heads}/{kv_heads} d={dim} bf16",
            lambda: rotary_embedding_triton(*args),
            lambda: rotary_embedding_torch(*args),
            check,
            2 * (q.numel() + k.numel()) * q.element_size() + tokens * 2 * dim * 2,
        )
    ]


FAMILIES = [
    attention_cases,
    kv_write_cases,
    input_prep_cases,
    sampling_cases,
    norm_cases,
    rotary_cases,
]


def peak_bandwidth(override: float | None) -> float | None:
    if override is not None or not ON_GPU:
        return override
    name = torch.cuda.get_device_name()
    return next((bw for key, bw in PEAK_BW_TBS if key in name), None)


def run_case(case: Case, peak_tbs: float | None) -> dict[str, Any]:
    row: dict[str, Any] = {"kernel": case.name, "shape": case.shape}
    # One broken kernel must not hide the others' numbers: errors become the row's verdict.
    try:
        row["max_err"], row["ok"] = case.check(), True
    except Exception as e:
        row["max_err"], row["ok"] = f"{type(e).__name__}: {e}", False
    if ON_GPU:
        import triton

        try:
            t_triton = triton.testing.do_bench(case.triton, return_mode="median")
            t_torch = triton.testing.do_bench(case.torch, return_mode="median")
        except Exception as e:
            row["ok"], row["timing_error"] = False, f"{type(e).__name__}: {e}"
            return row
        row.update(
            triton_us=t_triton * 1e3,
            torch_us=t_torch * 1e3,
            speedup=t_torch / t_triton,
            gbps=case.bytes / t_triton / 1e6,
        )
        if peak_tbs:
            row["frac_peak"] = row["gbps"] / (peak_tbs * 1e3)
    return row


def print_table(rows: list[dict[str, Any]]) -> None:
    header = f"{'kernel':22} {'shape':36} {'ok':3} {'max err':>9}"
    if ON_GPU:
        header += f" {'triton us':>10} {'torch us':>10} {'x':>6} {'GB/s':>8} {'% peak':>7}"
    print(header)
    for r in rows:
        err = f"{r['max_err']:9.2e}" if isinstance(r["max_err"], float) else "        -"
        line = f"{r['kernel']:22} {r['shape']:36} {'yes' if r['ok'] else 'NO':3} {err}"
        if "triton_us" in r:
            frac = f"{100 * r['frac_peak']:6.1f}%" if "frac_peak" in r else "      ?"
            line += (
                f" {r['triton_us']:10.1f} {r['torch_us']:10.1f} {r['speedup']:6.2f}"
                f" {r['gbps']:8.0f} {frac}"
            )
        print(line)
    for r in rows:
        for problem in (r["max_err"], r.get("timing_error")):
            if isinstance(problem, str):
                print(f"{r['kernel']}: {problem}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peak-bw", type=float, help="device peak bandwidth, TB/s")
    parser.add_argument("--small", action="store_true", help="small shapes on a GPU too")
    args = parser.parse_args()
    torch.manual_seed(0)
    small = args.small or not ON_GPU
    peak = peak_bandwidth(args.peak_bw)
    device_name = torch.cuda.get_device_name() if ON_GPU else "cpu (Triton interpreter)"
    print(f"device: {device_name}; peak bandwidth: {peak or 'unknown'} TB/s")
    if not ON_GPU:
        print("no GPU: correctness only, at small shapes; timing is skipped")
    rows: list[dict[str, Any]] = []
    skipped: list[str] = []
    for family in FAMILIES:
        try:
            cases = family(small)
        except ImportError as e:
            skipped.append(f"{family.__name__}: {e}")
            print(f"skipped {family.__name__}: {e}")
            continue
        except Exception as e:  # an API that moved: report it, run the rest
            rows.append(
                {
                    "kernel": family.__name__,
                    "shape": "",
                    "ok": False,
                    "max_err": f"setup failed: {type(e).__name__}: {e}",
                }
            )
            continue
        rows.extend(run_case(c, peak) for c in cases)
    print_table(rows)
    print(
        json.dumps(
            {
                "device": device_name,
                "peak_bw_tbs": peak,
                "timed": ON_GPU,
                "all_ok": all(r["ok"] for r in rows),
                "skipped": skipped,
                "results": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
