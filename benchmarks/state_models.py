"""The recurrent-state path's decode step against attention's, side by side: a random Mamba, a
random Qwen3.5 (three Gated DeltaNet layers to one gated attention layer) and a random Llama of
the same width and depth (HF transformers' configs, built here), each served by pdserve offline
(LLM), at batches of 1, 16 and 64 prompts; alternating rounds, medians. With --vllm-python,
vLLM's CPU build is tried on the same models as the anchor (batch 16): its step, or why it fails.

    .venv/bin/python benchmarks/state_models.py [--hidden 512] [--layers 8] [--rounds 3]
        [--vllm-python /work/vllm-venv/bin/python]

A step's cost is the difference between generating 2 x --output-len and --output-len tokens a
prompt (EOS ignored; medians of three interleaved runs each), over --output-len: the prompts'
prefill (--prompt-len tokens each) cancels out.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vs_vllm import try_vllm  # noqa: E402  (before any engine touched the environment)

from pdserve import LLM, SamplingParams  # noqa: E402
from tests.utils.tiny_models import make_tiny_model  # noqa: E402

ARCHS = ("mamba", "qwen3_5", "llama")


def build(arch: str, hidden: int, layers: int, root: Path) -> str:
    if arch == "mamba":
        shape = {"hidden_size": hidden, "intermediate_size": 2 * hidden, "time_step_rank": 32}
    else:  # head size 64, as vLLM's CPU attention takes
        shape = {"hidden_size": hidden, "intermediate_size": 4 * hidden}
        shape |= {"num_attention_heads": hidden // 64, "num_key_value_heads": hidden // 64}
    if arch == "qwen3_5":  # Qwen3.5's pattern and head shapes, narrowed to the width
        shape |= {
            "head_dim": 64,
            "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * (layers // 4),
            "linear_key_head_dim": 64,
            "linear_value_head_dim": 64,
            "linear_num_key_heads": hidden // 128,
            "linear_num_value_heads": hidden // 64,
        }
    return str(make_tiny_model(arch, root / arch, num_hidden_layers=layers, **shape))


def vllm_step_ms(python: Path, path: str, args: argparse.Namespace, batch: int) -> str:
    """vLLM's decode step on `path` at `batch` prompts, as step_ms measures it (two output
    lengths, one run each), or the error it fails with."""
    times = []
    for output_len in (args.output_len, 2 * args.output_len):
        job = {
            "engine_args": {"model": path, "dtype": args.dtype, "max_model_len": 256},
            "prompts": [
                [3 + (i * 7 + j) % 500 for j in range(args.prompt_len)] for i in range(batch)
            ],
            "output_len": output_len,
            "check_prompts": 0,
        }
        result = try_vllm(python, job, timeout=900)
        if isinstance(result, str):
            return result
        times.append(result["generate_s"])
    return f"{(times[1] - times[0]) / args.output_len * 1000:.2f} ms"


def step_ms(llm: LLM, batch: int, prompt_len: int, output_len: int, repeats: int = 3) -> float:
    prompts = [
        {"prompt_token_ids": [3 + (i * 7 + j) % 500 for j in range(prompt_len)]}
        for i in range(batch)
    ]

    def generate(max_tokens: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    generate(2)  # warm-up: this batch's shapes
    short, long = [], []
    for _ in range(repeats):  # interleaved, so that a slow moment hits both
        short.append(generate(output_len))
        long.append(generate(2 * output_len))
    return (statistics.median(long) - statistics.median(short)) / output_len * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--vllm-python", type=Path, help="python of vLLM's CPU build")
    args = parser.parse_args()
    os.environ.setdefault("PDSERVE_USE_V2_MODEL_RUNNER", "0")  # the state models' runner, for all
    with tempfile.TemporaryDirectory() as tmp:
        paths = {arch: build(arch, args.hidden, args.layers, Path(tmp)) for arch in ARCHS}
        results: dict[tuple[str, int], list[float]] = {}
        for _ in range(args.rounds):
            # One engine alive at a time: an idle one's threads would take the other's cores.
            for arch, path in paths.items():
                with LLM(
                    model=path, dtype=args.dtype, max_model_len=256, max_num_seqs=max(args.batches)
                ) as llm:
                    for batch in args.batches:
                        ms = step_ms(llm, batch, args.prompt_len, args.output_len)
                        results.setdefault((arch, batch), []).append(ms)
        print(
            f"decode step, ms (medians of {args.rounds}; {args.layers} layers of {args.hidden}, "
            f"{args.dtype}, load {os.getloadavg()[0]:.1f})"
        )
        print(f"{'batch':>6}" + "".join(f"{arch:>10}" for arch in ARCHS) + "  vs llama")
        for batch in args.batches:
            ms = {arch: statistics.median(results[(arch, batch)]) for arch in ARCHS}
            ratios = " ".join(f"{ms[arch] / ms['llama']:.2f}" for arch in ARCHS[:-1])
            print(f"{batch:>6}" + "".join(f"{ms[arch]:>10.2f}" for arch in ARCHS) + f"  {ratios}")
        if args.vllm_python:
            for arch in ARCHS:
                print(
                    f"vLLM CPU, {arch}, batch 16: {vllm_step_ms(args.vllm_python, paths[arch], args, 16)}"
                )


if __name__ == "__main__":
    main()
