"""The `pdserve` command line."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

from pdserve.config.args import add_engine_args, engine_kwargs

DEMO_PROMPTS = [
    "What is the capital of Germany? Answer in one sentence.",
    "Name three primary colors.",
    "Write one sentence about the ocean.",
]


def _vllm_serve_flags() -> set[str]:
    path = Path(__file__).with_name("vllm_serve_flags.txt")
    return {line for line in path.read_text().splitlines() if line and not line.startswith("#")}


def cmd_generate(args: argparse.Namespace) -> int:
    from pdserve import LLM, SamplingParams

    prompts = args.prompt or DEMO_PROMPTS
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, seed=args.sampling_seed
    )
    start = time.perf_counter()
    llm = LLM(**engine_kwargs(args))
    try:
        loaded = time.perf_counter()
        if args.no_chat:
            outputs = llm.generate(prompts, params, use_tqdm=False)
        else:
            outputs = llm.chat(
                [[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False
            )
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


def cmd_serve(args: argparse.Namespace) -> int:
    from pdserve.entrypoints.openai.api_server import run_server

    return run_server(args, engine_kwargs(args))


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from pdserve.entrypoints.bench_serve import run_bench_serve

    result = run_bench_serve(args)
    return 0 if result["completed"] > 0 and result["failed"] == 0 else 1


def cmd_proxy(args: argparse.Namespace) -> int:
    from pdserve.proxy.app import run_proxy

    return run_proxy(args)


def cmd_export(args: argparse.Namespace) -> int:
    from pdserve.models.loader.export import export_hf_folder

    start = time.perf_counter()
    output = export_hf_folder(args.model, args.output, args.dtype)
    print(f"Wrote {output} ({args.dtype}) in {time.perf_counter() - start:.1f} s")
    return 0


def cmd_launch(args: argparse.Namespace) -> int:
    from pdserve.entrypoints.launch import run_launch

    return run_launch(args, args.instance_args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve")
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="offline generation for a few prompts")
    add_engine_args(gen)
    gen.add_argument(
        "--prompt", action="append", help="a prompt (repeatable); default: demo prompts"
    )
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument(
        "--no-chat", action="store_true", help="plain completion instead of the chat template"
    )
    gen.set_defaults(func=cmd_generate)

    from pdserve.entrypoints.bench_serve import add_bench_serve_args
    from pdserve.entrypoints.launch import add_launch_args
    from pdserve.entrypoints.openai.api_server import add_serve_args
    from pdserve.proxy.app import add_proxy_args

    serve = sub.add_parser("serve", help="the OpenAI-compatible HTTP server")
    serve.add_argument(
        "model_tag", nargs="?", metavar="MODEL", help="the model, as `vllm serve MODEL` takes it"
    )
    add_engine_args(serve)
    add_serve_args(serve)
    serve.set_defaults(func=cmd_serve)

    proxy = sub.add_parser("proxy", help="the prefill/decode proxy")
    add_proxy_args(proxy)
    proxy.set_defaults(func=cmd_proxy)

    launch = sub.add_parser(
        "launch",
        help="prefill and decode instances and the proxy, as child processes",
        epilog="Other flags (e.g. --dtype float32) are passed on to every instance.",
    )
    add_launch_args(launch)
    launch.set_defaults(func=cmd_launch)

    export = sub.add_parser(
        "export", help="write a GGUF model as an HF folder (config, safetensors, tokenizer)"
    )
    export.add_argument(
        "--model", default="default", help="a .gguf file, or default: bundled SmolLM2-135M-Instruct"
    )
    export.add_argument("--output", required=True, help="the folder to write (absent or empty)")
    export.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    export.set_defaults(func=cmd_export)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    bench_serve = bench.add_parser("serve", help="Poisson load against a running server")
    add_bench_serve_args(bench_serve)
    bench_serve.set_defaults(func=cmd_bench_serve)

    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "launch":
        vllm_only = [a.split("=")[0] for a in extra if a.split("=")[0] in _vllm_serve_flags()]
        if vllm_only:
            parser.error(
                f"{', '.join(vllm_only)}: vLLM flag(s) pdserve does not support (yet); "
                "docs/serving.md lists the ones it takes"
            )
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.instance_args = extra
    if getattr(args, "model_tag", None) is not None:
        if args.model is not None and args.model != args.model_tag:
            parser.error(f"the model is given twice: {args.model_tag} and --model {args.model}")
        args.model = args.model_tag
    # Engine and worker processes read it from the environment they inherit.
    os.environ["PDSERVE_LOG_LEVEL"] = args.log_level.upper()
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
