"""Batch invariance of a server: the same greedy request, answered alone and then inside a crowd.

For each deployment (`pdserve serve`, and `pdserve launch` with one prefill and one decode
instance behind the proxy), on the default model in bf16 unless --model/--dtype say otherwise:
each of --probes requests (20..160 prompt words, --max-tokens tokens, greedy) is answered alone,
one after the other; then all of them again at once among --crowd other requests of random
lengths. A probe counts as identical when its tokens are. The split's lone answers are also
compared with the single instance's (the split's promise: a single instance's tokens).

--vllm-python V/bin/python runs the same probes against vLLM's CPU build (`vllm serve` on the
same weights, exported as benchmarks/vs_vllm.py does) first, as the peer.

--baseline DIR runs the same deployments from another pdserve checkout (say `git worktree add
DIR <commit>`), started in that directory (so that `python -m pdserve` imports it), for a
before/after in one run.

Usage: .venv/bin/python benchmarks/batch_invariance.py [--model M] [--dtype bfloat16]
       [--probes 12] [--crowd 48] [--max-tokens 64] [--baseline DIR] [--vllm-python P]
Prints a table and a final JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# The environment this script was started with: vLLM runs in it, not in what `import pdserve`
# adds for pdserve's own processes (its OpenMP defaults).
USER_ENV = dict(os.environ)

from serving import launch_server, stop_server, wait_healthy  # noqa: E402

from pdserve.utils import get_open_port  # noqa: E402

WORDS = (
    "the river city morning light garden history music people travel bread winter market "
    "science quiet letter mountain story school friend window ocean kitchen machine paper "
    "summer road language forest question answer evening family village train color"
).split()


def prompts(rng: random.Random, n: int, low: int, high: int) -> list[str]:
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high))) for _ in range(n)]


async def complete(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int) -> list:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    body |= {"ignore_eos": True, "return_token_ids": True}  # vLLM returns ids when asked
    response = await client.post("/v1/completions", json=body)
    response.raise_for_status()
    return response.json()["choices"][0]["token_ids"]


async def probe(base_url: str, args: argparse.Namespace) -> tuple[list, list]:
    """(each probe's tokens alone, each probe's tokens in the crowd)."""
    rng = random.Random(0)
    probes = prompts(rng, args.probes, 20, 160)
    crowd = prompts(rng, args.crowd, 1, 300)
    crowd_tokens = [rng.randint(1, 2 * args.max_tokens) for _ in crowd]
    async with httpx.AsyncClient(base_url=base_url, timeout=1800) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        alone = [await complete(client, model, p, args.max_tokens) for p in probes]
        jobs = [complete(client, model, p, args.max_tokens) for p in probes]
        jobs += [complete(client, model, p, n) for p, n in zip(crowd, crowd_tokens, strict=True)]
        order = list(range(len(jobs)))
        rng.shuffle(order)  # the probes scattered through the crowd's arrival order
        done = await asyncio.gather(*(jobs[i] for i in order))
        together = dict(zip(order, done, strict=True))
    return alone, [together[i] for i in range(len(probes))]


def run(command: str, server_args: list[str], checkout: Path | None, args) -> tuple[list, list]:
    port = get_open_port()
    proc = launch_server(port, server_args, command, cwd=checkout)
    return serve_and_probe(proc, port, args)


def serve_and_probe(proc: subprocess.Popen, port: int, args) -> tuple[list, list]:
    try:
        base_url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, base_url)
        return asyncio.run(probe(base_url, args))
    finally:
        stop_server(proc)


def run_vllm(args) -> tuple[list, list]:
    """vLLM's OpenAI server on the exported weights, with vs_vllm.py's fairness settings."""
    from vs_vllm import engine_env, resolve_model

    args.cache_dir.mkdir(parents=True, exist_ok=True)
    model = resolve_model(args.model or "default", args.dtype, args.cache_dir)
    port = get_open_port()
    cmd = [str(args.vllm_python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    cmd += ["--port", str(port), "--dtype", args.dtype, "--max-model-len", "2048"]
    vllm_env = engine_env("vllm", len(os.sched_getaffinity(0)), kv_cache_gib=2)
    env = {**USER_ENV, **{k: v for k, v in vllm_env.items() if k.startswith("VLLM_")}}
    with open(args.cache_dir / "batch_invariance-vllm.log", "w") as log:
        proc = subprocess.Popen(
            cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    return serve_and_probe(proc, port, args)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="default: the bundled default model")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--probes", type=int, default=12)
    parser.add_argument("--crowd", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--baseline", type=Path, help="a pdserve checkout to run as well")
    parser.add_argument("--vllm-python", type=Path, help="vLLM's environment's python: the peer")
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache/pdserve-bench")
    args = parser.parse_args()
    server_args = ["--dtype", args.dtype, *(["--model", args.model] if args.model else [])]
    checkouts = {"this": None, **({"baseline": args.baseline.resolve()} if args.baseline else {})}
    deployments = {
        "serve": ("serve", server_args),
        "launch 1P1D": ("launch", [*server_args, "--pd-min-uncached-tokens", "0"]),
    }
    results = []
    print(f"{'checkout':<10}{'deployment':<13}{'identical alone vs crowd':>26}{'= single':>10}")
    if args.vllm_python:
        alone, together = run_vllm(args)
        same = sum(a == b for a, b in zip(alone, together, strict=True))
        print(f"{'vllm':<10}{'serve':<13}{f'{same}/{len(alone)}':>26}", flush=True)
        results.append({"checkout": "vllm", "deployment": "serve", "identical": same})
    for checkout, path in checkouts.items():
        single_alone = None
        for name, (command, flags) in deployments.items():
            alone, together = run(command, flags, path, args)
            same = sum(a == b for a, b in zip(alone, together, strict=True))
            single_alone = single_alone or alone
            as_single = sum(a == b for a, b in zip(alone, single_alone, strict=True))
            print(
                f"{checkout:<10}{name:<13}{f'{same}/{len(alone)}':>26}"
                f"{f'{as_single}/{len(alone)}':>10}",
                flush=True,
            )
            first_differences = [
                next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
                for a, b in zip(alone, together, strict=True)
            ]
            results.append(
                {
                    "checkout": checkout,
                    "deployment": name,
                    "identical": same,
                    "probes": len(alone),
                    "equal_to_single_alone": as_single,
                    "first_differences": [d for d in first_differences if d is not None],
                }
            )
    print(json.dumps({"benchmark": "batch_invariance", "dtype": args.dtype, "runs": results}))


if __name__ == "__main__":
    main()
