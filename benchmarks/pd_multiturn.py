"""Multi-turn chat with shared prefixes over one 2P2D deployment, routed three ways: pdserve's
proxy round robin, pdserve's proxy by cache and load (its default), and vllm-router's
`cache_aware` policy in its PD mode (installed in its own venv on first use).

Every conversation opens with one system prompt shared by all; each turn repeats the earlier
turns (the answers the deployment gave) and adds a question. Conversations run concurrently,
their turns one after another, streamed. The instances are the same for the three routers (one
`pdserve launch --prefill 2 --decode 2`); each router gets its own system prompt and questions,
so none finds the previous router's prefixes cached. Printed side by side: the prefix hit rate
(1 - prompt tokens the instances computed / prompt tokens sent), KV bytes handed over, TTFT and
ITL p50/p99, and the requests each router kept off the prefill leg.

Usage: python benchmarks/pd_multiturn.py [--conversations 12 --turns 5 --concurrency 4]
       [-- flags for every instance, e.g. --model M --dtype float32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from serving import launch_server, stop_server, wait_healthy  # noqa: E402

from pdserve.utils import get_open_port  # noqa: E402
from tests.utils.server import MetricsReader  # noqa: E402
from tests.utils.vllm_router import Router  # noqa: E402

WORDS = (
    "system model cache block token prefill decode router instance request latency memory "
    "transfer prompt answer question policy network kernel thread queue batch layer weight"
).split()


def sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."


async def turn(
    client: httpx.AsyncClient, model: str, messages: list[dict], max_tokens: int
) -> tuple[str, float, list[float], int]:
    """One streamed chat turn: its answer, TTFT, inter-token gaps and prompt tokens."""
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    stamps, text, prompt_tokens = [], [], 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                prompt_tokens = chunk["usage"]["prompt_tokens"]
            for choice in chunk.get("choices", []):
                if choice["delta"].get("content"):
                    stamps.append(time.perf_counter() - start)
                    text.append(choice["delta"]["content"])
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return "".join(text), stamps[0], gaps, prompt_tokens


async def conversations(url: str, model: str, args: argparse.Namespace, seed: int) -> dict:
    rng = random.Random(seed)
    system = " ".join(sentence(rng, 12) for _ in range(args.system_sentences))
    ttfts: list[float] = []
    itls: list[float] = []
    prompt_tokens = 0
    sem = asyncio.Semaphore(args.concurrency)
    questions = [
        [sentence(rng, args.question_words) for _ in range(args.turns)]
        for _ in range(args.conversations)
    ]
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:

        async def conversation(c: int) -> None:
            nonlocal prompt_tokens
            messages = [{"role": "system", "content": system}]
            async with sem:
                for q in questions[c]:
                    messages.append({"role": "user", "content": q})
                    answer, ttft, gaps, n = await turn(client, model, messages, args.max_tokens)
                    messages.append({"role": "assistant", "content": answer})
                    ttfts.append(ttft)
                    itls.extend(gaps)
                    prompt_tokens += n

        start = time.perf_counter()
        await asyncio.gather(*(conversation(c) for c in range(args.conversations)))
    return {
        "ttfts": ttfts,
        "itls": itls,
        "prompt_tokens": prompt_tokens,
        "duration_s": time.perf_counter() - start,
    }


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] * 1000


def instance_counters(readers: dict[str, list[MetricsReader]]) -> dict[str, float]:
    everyone = readers["prefill"] + readers["decode"]
    return {
        "computed": sum(
            r.metric("prompt_tokens_by_source_total", source="local_compute") for r in everyone
        ),
        "kv_bytes": sum(r.metric("kv_transfer_bytes_total") for r in readers["decode"]),
        "prefill_requests": sum(
            r.metric("request_success_total", finished_reason="length") for r in readers["prefill"]
        ),  # fmt: skip
    }


def run(
    label: str, url: str, model: str, readers: dict, args: argparse.Namespace, seed: int
) -> dict:
    before = instance_counters(readers)
    out = asyncio.run(conversations(url, model, args, seed))
    after = instance_counters(readers)
    computed = after["computed"] - before["computed"]
    requests = args.conversations * args.turns
    return {
        "label": label,
        "prefix_hit_rate": 1 - computed / out["prompt_tokens"],
        "kv_mib": (after["kv_bytes"] - before["kv_bytes"]) / 2**20,
        "prefill_legs": after["prefill_requests"] - before["prefill_requests"],
        "requests": requests,
        "ttft_p50_ms": statistics.median(out["ttfts"]) * 1000,
        "ttft_p99_ms": pct(out["ttfts"], 0.99),
        "itl_p50_ms": statistics.median(out["itls"]) * 1000,
        "itl_p99_ms": pct(out["itls"], 0.99),
        "duration_s": out["duration_s"],
    }


ROWS = (
    ("prefix hit rate", "prefix_hit_rate", ".2f"),
    ("KV handed over (MiB)", "kv_mib", ".1f"),
    ("prefill legs", "prefill_legs", ".0f"),
    ("TTFT p50 (ms)", "ttft_p50_ms", ".1f"),
    ("TTFT p99 (ms)", "ttft_p99_ms", ".1f"),
    ("ITL p50 (ms)", "itl_p50_ms", ".1f"),
    ("ITL p99 (ms)", "itl_p99_ms", ".1f"),
    ("duration (s)", "duration_s", ".1f"),
)


def main() -> None:
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--conversations", type=int, default=12)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--system-sentences", type=int, default=20)
    parser.add_argument("--question-words", type=int, default=24)
    args = parser.parse_args(argv[:split])
    instance_args = argv[split + 1 :]
    port = get_open_port()
    url = f"http://127.0.0.1:{port}"
    launch = launch_server(port, ["--prefill", "2", "--decode", "2", *instance_args], "launch")
    proxies = []
    try:
        wait_healthy(launch, url)
        health = httpx.get(f"{url}/health").json()
        addresses = {role: [i["url"] for i in health[role]] for role in ("prefill", "decode")}
        readers = {role: [MetricsReader(u) for u in urls] for role, urls in addresses.items()}
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        rr_port = get_open_port()
        proxy_args = ["--prefill", *(u.removeprefix("http://") for u in addresses["prefill"])]
        proxy_args += ["--decode", *(u.removeprefix("http://") for u in addresses["decode"])]
        proxies.append(launch_server(rr_port, [*proxy_args, "--routing", "round_robin"], "proxy"))
        wait_healthy(proxies[-1], f"http://127.0.0.1:{rr_port}")
        # Warm-up: handshakes between every pair, first allocations.
        warm = argparse.Namespace(**{**vars(args), "conversations": 4, "turns": 1})
        asyncio.run(conversations(f"http://127.0.0.1:{rr_port}", model, warm, 99))
        results = [
            run("round robin", f"http://127.0.0.1:{rr_port}", model, readers, args, 1),
            run("pdserve cache-aware", url, model, readers, args, 2),
        ]
        log = Path(tempfile.gettempdir()) / "pd_multiturn_vllm_router.log"
        policy = ["--prefill-policy", "cache_aware", "--decode-policy", "cache_aware"]
        with Router(addresses["prefill"], addresses["decode"], *policy, log=log) as router:
            results.append(run("vllm-router cache_aware", router.url, model, readers, args, 3))
    finally:
        for proc in proxies:
            stop_server(proc)
        stop_server(launch)
    width = max(len(r["label"]) for r in results) + 2
    print("".ljust(22) + "".join(r["label"].rjust(width) for r in results))
    for title, key, fmt in ROWS:
        print(title.ljust(22) + "".join(format(r[key], fmt).rjust(width) for r in results))
    print(
        f"({args.conversations} conversations x {args.turns} turns, {args.concurrency} at a time, "
        f"{args.max_tokens} tokens per answer; 2P2D by pdserve launch)"
    )
    print(json.dumps({"benchmark": "pd_multiturn", "results": results}))


if __name__ == "__main__":
    main()
