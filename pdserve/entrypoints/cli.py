"""The `pdserve` command line."""

from __future__ import annotations

import argparse
import logging
import sys
import time

DEMO_PROMPTS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write one sentence about the ocean.",
]


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine flags, with vLLM's names."""
    parser.add_argument("--model", default=None, help="HF folder or .gguf file (default: bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-gpu-blocks-override", type=int, default=None)
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    parser.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    parser.add_argument("--distributed-executor-backend", choices=["uni", "mp", "ray"], default=None)
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")


def engine_kwargs(args: argparse.Namespace) -> dict:
    names = [
        "model", "dtype", "max_model_len", "block_size", "num_gpu_blocks_override",
        "enable_prefix_caching", "max_num_seqs", "max_num_batched_tokens",
        "enable_chunked_prefill", "seed", "tensor_parallel_size", "pipeline_parallel_size",
        "distributed_executor_backend", "enforce_eager",
    ]
    return {n: getattr(args, n) for n in names}


def cmd_generate(args: argparse.Namespace) -> int:
    from pdserve import LLM, SamplingParams

    prompts = args.prompt or DEMO_PROMPTS
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.sampling_seed)
    start = time.perf_counter()
    llm = LLM(**engine_kwargs(args))
    try:
        loaded = time.perf_counter()
        if args.no_chat:
            outputs = llm.generate(prompts, params, use_tqdm=False)
        else:
            outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
        done = time.perf_counter()
    finally:
        llm.shutdown()
    num_tokens = 0
    for prompt, out in zip(prompts, outputs):
        num_tokens += len(out.outputs[0].token_ids)
        print(f"Prompt: {prompt!r}\nAnswer: {out.outputs[0].text!r}\n")
    print(
        f"{len(prompts)} prompts, {num_tokens} tokens in {done - loaded:.2f} s "
        f"({num_tokens / (done - loaded):.1f} tok/s; engine start {loaded - start:.1f} s)"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve")
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="offline generation for a few prompts")
    add_engine_args(gen)
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable); default: demo prompts")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("--no-chat", action="store_true", help="plain completion instead of the chat template")
    gen.set_defaults(func=cmd_generate)

    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
