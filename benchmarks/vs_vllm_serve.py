"""Online serving side by side: `pdserve serve` and vLLM's OpenAI server on the same HF folder,
one after the other, each driven by `pdserve bench serve`'s load generator at the same fixed
request rate (Poisson arrivals, the same seed, the same built-in prompts, streamed, EOS ignored).

Usage: .venv/bin/python benchmarks/vs_vllm_serve.py [--model default|tiny|PATH]
       [--request-rate 1] [--num-prompts 32] [--max-tokens 64] [--rounds 1]
       [--vllm-python V/bin/python] [--enforce-eager]

Set-up, models, threads, KV cache memory and engine limits as in benchmarks/vs_vllm.py (same
flags). vLLM runs as `V/bin/python -m vllm.entrypoints.openai.api_server` (its access log off,
as pdserve's is). Each server is started, waited for (/health; the time from launch to healthy is
its start-up), sent one short warm-up request, benchmarked, and stopped with its whole process
group, also on Ctrl-C, SIGTERM or failure. Server logs go to --cache-dir/logs. Prints each
server's table side by side, throughput and TTFT / ITL p50 / p99 with the ratio pdserve / vLLM
(medians over --rounds), and a final JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from serving import stop_server, wait_healthy  # noqa: E402
from vs_vllm import (  # noqa: E402
    ENGINES,
    add_common_args,
    check_common_args,
    engine_env,
    print_log_tail,
    resolve_model,
    stop_on_sigterm,
)

from pdserve.entrypoints.bench_serve import (  # noqa: E402
    CHAT,
    COMPLETIONS,
    PROMPTS,
    benchmark,
    fetch_model,
    format_table,
    sample_prompts,
)
from pdserve.utils import get_open_port  # noqa: E402

# (label, key in bench_serve's summary); throughput first, then latencies in ms.
METRICS = [
    ("output tok/s", "output_throughput"),
    ("TTFT p50 ms", "p50_ttft_ms"),
    ("TTFT p99 ms", "p99_ttft_ms"),
    ("ITL p50 ms", "p50_itl_ms"),
    ("ITL p99 ms", "p99_itl_ms"),
]
WARMUP_TOKENS = 4
# The longest prompt: a worker of vLLM 0.32 on CPU whose first forward covers only a few tokens
# dies of SIGILL (see WARMUP_PROMPT_LEN in vs_vllm_driver.py).
WARMUP_PROMPT = max(PROMPTS, key=len)


def server_command(engine: str, model: Path, port: int, args: argparse.Namespace) -> list[str]:
    """Both servers' flags carry vLLM's names."""
    block_size = args.vllm_block_size if engine == "vllm" else args.pdserve_block_size
    flags = [
        "--model", str(model),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--dtype", args.dtype,
        "--max-model-len", str(args.max_model_len),
        "--max-num-seqs", str(args.max_num_seqs),
        "--max-num-batched-tokens", str(args.max_num_batched_tokens),
        "--block-size", str(block_size),
        "--seed", "0",
    ]  # fmt: skip
    if args.enforce_eager:
        flags.append("--enforce-eager")
    if engine == "vllm":
        api_server = "vllm.entrypoints.openai.api_server"
        return [str(args.vllm_python), "-m", api_server, *flags, "--disable-uvicorn-access-log"]
    return [sys.executable, "-m", "pdserve.entrypoints.cli", "serve", *flags]


def bench_fresh_server(
    argv: list[str],
    env: dict[str, str],
    port: int,
    log: Path,
    endpoint: str,
    warmup_prompt: str,
    load_args: tuple,
    label: str,
) -> dict:
    """Start a server (its own process group, so that stop_server reaches its engine processes
    too), wait for /health, send one short warm-up request, run `benchmark` with `load_args`
    (prompts, request rate, max tokens, seed) and stop it, also on failure. The summary, with
    the start-up time and the machine's load at the start."""
    base_url = f"http://127.0.0.1:{port}"
    with open(log, "w") as out:
        launched = time.perf_counter()
        proc = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            try:
                wait_healthy(proc, base_url)
            except (RuntimeError, TimeoutError):
                print_log_tail(log)
                raise
            startup_s = time.perf_counter() - launched
            name = asyncio.run(fetch_model(base_url))
            warmup = asyncio.run(
                benchmark(base_url, endpoint, name, [warmup_prompt], 1.0, WARMUP_TOKENS, 0)
            )
            if warmup["failed"]:
                raise RuntimeError(f"{label}: the warm-up request failed: {warmup['errors']}")
            load = os.getloadavg()[0]  # the context of the figures on shared cores
            result = asyncio.run(benchmark(base_url, endpoint, name, *load_args, label=label))
        finally:
            stop_server(proc)
    if result["failed"]:
        print_log_tail(log)
        raise RuntimeError(f"{label}: {result['failed']} requests failed: {result['errors'][:3]}")
    return {**result, "startup_s": startup_s, "load": load}


def bench_server(engine: str, model: Path, round_: int, args: argparse.Namespace) -> dict:
    port = get_open_port()
    log = args.cache_dir / "logs" / f"vs_vllm_serve-{model.name}-{engine}-{round_}.log"
    load_args = (sample_prompts(args.num_prompts), args.request_rate, args.max_tokens, args.seed)
    result = bench_fresh_server(
        server_command(engine, model, port, args),
        engine_env(engine, args.threads, args.kv_cache_gib),
        port,
        log,
        args.endpoint,
        WARMUP_PROMPT,
        load_args,
        f"{engine} {round_}",
    )
    return {**result, "engine": engine, "round": round_}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_common_args(parser)
    parser.add_argument("--request-rate", type=float, default=1.0, help="requests/s (Poisson)")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--endpoint", default=COMPLETIONS, choices=[COMPLETIONS, CHAT])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    check_common_args(parser, args)
    stop_on_sigterm()

    args.cache_dir.mkdir(parents=True, exist_ok=True)
    (args.cache_dir / "logs").mkdir(exist_ok=True)
    model = resolve_model(args.model, args.dtype, args.cache_dir)
    results = []
    for round_ in range(1, args.rounds + 1):
        for engine in ENGINES:
            result = bench_server(engine, model, round_, args)
            print(
                f"{engine} round {round_}: healthy after {result['startup_s']:.1f} s; "
                f"load {result['load']:.1f} when the benchmark started",
                flush=True,
            )
            results.append(result)

    print(format_table(results))
    median = {
        engine: {
            key: statistics.median(r[key] for r in results if r["engine"] == engine)
            for _, key in [*METRICS, ("start-up s", "startup_s")]
        }
        for engine in ENGINES
    }
    print(f"{'median':<14}{'pdserve':>10}{'vLLM':>10}{'pdserve/vLLM':>14}")
    for label, key in [*METRICS, ("start-up s", "startup_s")]:
        pd, vl = median["pdserve"][key], median["vllm"][key]
        print(f"{label:<14}{pd:>10.1f}{vl:>10.1f}{pd / vl if vl else float('nan'):>14.2f}")
    mode = "eager" if args.enforce_eager else "compiled"
    print(
        f"({args.num_prompts} prompts x {args.max_tokens} tokens at {args.request_rate} req/s, "
        f"{args.model}, {args.dtype}, vLLM {mode}, {args.threads} threads, medians of "
        f"{args.rounds} rounds)"
    )
    print(
        json.dumps(
            {
                "benchmark": "vs_vllm_serve",
                "model": args.model,
                "dtype": args.dtype,
                "endpoint": args.endpoint,
                "num_prompts": args.num_prompts,
                "max_tokens": args.max_tokens,
                "request_rate": args.request_rate,
                "rounds": args.rounds,
                "threads": args.threads,
                "vllm_mode": mode,
                **{
                    f"{engine}_{key}": round(value, 2)
                    for engine in ENGINES
                    for key, value in median[engine].items()
                },
                "throughput_ratio": round(
                    median["pdserve"]["output_throughput"] / median["vllm"]["output_throughput"],
                    3,
                ),
            }
        )
    )


if __name__ == "__main__":
    main()
