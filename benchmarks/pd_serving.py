"""The same workload against one monolithic instance and against 1P1D behind the proxy.

Poisson arrivals over the fixed prompt set of `pdserve bench serve`; the deployments run one
after the other (they would share the same cores side by side) and their TTFT, ITL and throughput
percentiles are printed side by side, then as one JSON line. The split runs twice: as `pdserve
launch` starts it (an idle instance lends its cores to the other, executor/cpu_cores.py), and
with each instance's threads fixed at its share (PDSERVE_CPU_THREADS), nothing lent.

Multi-turn chat with shared prefixes, routed three ways over one 2P2D deployment (round robin,
pdserve's cache-aware proxy, vllm-router's cache_aware), is benchmarks/pd_multiturn.py.

Usage: python benchmarks/pd_serving.py [--num-prompts 32 --request-rate 1 --max-tokens 32]
       [-- flags for every instance, e.g. --model M --dtype float32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from serving import launch_server, stop_server, wait_healthy  # noqa: E402

from pdserve.entrypoints.bench_serve import benchmark, fetch_model, format_table, sample_prompts  # noqa: E402
from pdserve.utils import get_open_port  # noqa: E402


def run_one(
    label: str, command: str, server_args: list[str], args: argparse.Namespace, env: dict[str, str]
) -> dict:
    port = get_open_port()
    base_url = f"http://127.0.0.1:{port}"
    proc = launch_server(port, server_args, command, env)
    try:
        wait_healthy(proc, base_url)
        model = asyncio.run(fetch_model(base_url))
        # One request first, so that neither side is timed on its first handshake or warm-up.
        asyncio.run(
            benchmark(base_url, args.endpoint, model, sample_prompts(1), float("inf"), 4, args.seed)
        )
        return asyncio.run(
            benchmark(
                base_url,
                args.endpoint,
                model,
                sample_prompts(args.num_prompts),
                args.request_rate,
                args.max_tokens,
                args.seed,
                label=label,
            )
        )
    finally:
        stop_server(proc)


def main() -> None:
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--request-rate", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--endpoint", default="/v1/chat/completions")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv[:split])
    server_args = argv[split + 1 :]
    share = str(max(1, (os.cpu_count() or 1) // 2))
    results = [
        run_one("monolithic", "serve", server_args, args, {}),
        run_one("1P1D proxy", "launch", server_args, args, {}),
        run_one("1P1D not lent", "launch", server_args, args, {"PDSERVE_CPU_THREADS": share}),
    ]
    print(format_table(results))
    print(json.dumps({"benchmark": "pd_serving", "results": results}))


if __name__ == "__main__":
    main()
