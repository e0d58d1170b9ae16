"""`bench serve`, as `vllm bench serve`: streamed requests at Poisson arrivals to an OpenAI-compatible
server; TTFT / ITL / E2E percentiles and throughput. The prompt set is fixed and built in, so runs
against different servers (or the same server on different days) measure the same workload."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np

from pdserve.entrypoints.bench_spec import fetch_spec_counters, spec_summary, spec_table_lines

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
PERCENTILES = (50, 90, 99)
MAX_ERRORS_SHOWN = 5
# vLLM's bound: a request may sit in a long queue, and aiohttp's default (5 min) would fail it.
REQUEST_TIMEOUT_S = 6 * 3600

TABLE_ROWS: list[tuple[str, str, str]] = [
    ("Successful requests", "completed", "d"),
    ("Failed requests", "failed", "d"),
    ("Benchmark duration (s)", "duration", ".2f"),
    ("Total input tokens", "total_input_tokens", "d"),
    ("Total generated tokens", "total_output_tokens", "d"),
    ("Request throughput (req/s)", "request_throughput", ".2f"),
    ("Output token throughput (tok/s)", "output_throughput", ".2f"),
    ("Total token throughput (tok/s)", "total_token_throughput", ".2f"),
] + [
    (f"{stat} {name} (ms)", f"{stat.lower()}_{key}_ms", ".2f")
    for key, name in (("ttft", "TTFT"), ("itl", "ITL"), ("e2el", "E2E latency"))
    for stat in ("Mean", *(f"P{p}" for p in PERCENTILES))
]

PROMPTS: tuple[str, ...] = (
    "What is the capital of France?",
    "Name three primary colors.",
    "Write one sentence about the ocean.",
    "Explain photosynthesis to a child.",
    "Give me five facts about the planet Mars.",
    "What causes the tides?",
    "Translate 'good morning, how are you?' into Spanish and German.",
    "Write a haiku about autumn leaves falling in a quiet park.",
    "What is the difference between a virus and a bacterium?",
    "Describe how a bicycle works, from the pedals to the wheels, for someone who has never seen one.",
    "List the steps to bake a loaf of bread at home, starting from flour, water, salt and yeast.",
    "Summarize the plot of Romeo and Juliet in a short paragraph.",
    "Why is the sky blue during the day and red at sunset?",
    "Write a short story about a robot who learns to paint, in which the robot first copies famous "
    "paintings, then slowly finds its own style, and finally opens a small gallery in a seaside town.",
    "How do vaccines train the immune system?",
    "Explain recursion with an example in Python.",
    "Compare trains and airplanes for a 500 kilometre trip: cost, time, comfort and emissions.",
    "Write a polite email to a colleague asking to move tomorrow's meeting to Friday afternoon, "
    "explaining that a customer visit was scheduled at the same time and cannot be moved.",
    "What were the main causes of the First World War?",
    "How does a refrigerator keep food cold?",
    "Describe the water cycle, naming each stage and what drives it.",
    "Give three tips for learning a new language as an adult.",
    "You are a tour guide in Rome. A group of tourists has just arrived at the Colosseum and has "
    "one hour before lunch. They are interested in gladiators, architecture and how the building "
    "was used after the fall of the empire. Tell them what they are looking at and what to see first.",
    "Write a limerick about a cat who loves cheese.",
    "Describe a sunrise over the mountains.",
    "What is the Pythagorean theorem, and where is it used in everyday life?",
    "Explain what inflation is and why central banks raise interest rates to fight it.",
    "A farmer has chickens and cows. Together they have 30 heads and 74 legs. How many chickens "
    "and how many cows does the farmer have? Show your reasoning step by step.",
    "What is machine learning?",
    "Tell me a fun fact about octopuses.",
    "Write a product description for a waterproof hiking backpack with a 30 litre capacity.",
    "Explain how the printing press changed Europe in the fifteenth and sixteenth centuries, "
    "covering literacy, religion, science and the spread of news.",
)


@dataclass
class RequestResult:
    ok: bool = False
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str = ""


def sample_prompts(num_prompts: int) -> list[str]:
    # Cycled, not sampled: every run and every server gets the same prompts in the same order.
    return [PROMPTS[i % len(PROMPTS)] for i in range(num_prompts)]


def arrival_offsets(num_requests: int, request_rate: float, seed: int) -> list[float]:
    """Send times (seconds after the start) of a Poisson process, the first at 0."""
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    gaps = [rng.expovariate(request_rate) for _ in range(num_requests)]
    return list(itertools.accumulate(gaps, initial=0.0))[:num_requests]


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def build_payload(
    endpoint: str, model: str, prompt: str, max_tokens: int, ignore_eos: bool
) -> dict:
    payload: dict = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    # Absent rather than false: servers without the extension (OpenAI's own) reject unknown fields.
    if ignore_eos:
        payload["ignore_eos"] = True
    if endpoint == CHAT:
        payload["messages"] = [{"role": "user", "content": prompt}]
    else:
        payload["prompt"] = prompt
    return payload


def chunk_text(chunk: dict) -> str:
    """Generated text of a completions (`text`) or chat (`delta.content`) chunk."""
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    if "delta" in choices[0]:
        return choices[0]["delta"].get("content") or ""
    return choices[0].get("text") or ""


async def send_request(
    session: aiohttp.ClientSession, url: str, payload: dict, headers: dict[str, str]
) -> RequestResult:
    result = RequestResult()
    num_chunks = 0
    start = last = time.perf_counter()
    try:
        async with session.post(url, json=payload, headers=headers) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return result
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):  # blank event separators, ": keep-alive" comments
                    continue
                data = line[len(b"data:") :].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = f"error in stream: {chunk['error']}"
                    return result
                if usage := chunk.get("usage"):
                    result.prompt_tokens = usage.get("prompt_tokens", 0)
                    result.output_tokens = usage.get("completion_tokens", 0)
                if chunk_text(chunk):
                    now = time.perf_counter()
                    if num_chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    num_chunks += 1
    except Exception as e:  # the network boundary: any failure is this request's, not the run's
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.latency = time.perf_counter() - start
    if num_chunks == 0:
        result.error = "stream ended without generated text"
        return result
    # Without a usage chunk, one token per chunk is what OpenAI-compatible servers stream.
    result.output_tokens = result.output_tokens or num_chunks
    result.ok = True
    return result


def summarize(results: list[RequestResult], duration: float) -> dict:
    done = [r for r in results if r.ok]
    input_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    summary: dict = {
        "duration": duration,
        "completed": len(done),
        "failed": len(results) - len(done),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
    }
    series = {
        "ttft": [r.ttft for r in done],
        "itl": [gap for r in done for gap in r.itl],
        "e2el": [r.latency for r in done],
    }
    for name, values in series.items():
        ms = np.asarray(values or [0.0]) * 1000  # as vLLM: 0, not NaN, when nothing completed
        summary[f"mean_{name}_ms"] = float(ms.mean())
        for p in PERCENTILES:
            summary[f"p{p}_{name}_ms"] = float(np.percentile(ms, p))
    summary["errors"] = [r.error for r in results if not r.ok]
    return summary


async def fetch_model(base_url: str, api_key: str | None = None) -> str:
    """The first model the server lists at /v1/models."""
    async with aiohttp.ClientSession() as session:
        async with session.get(
            base_url.rstrip("/") + "/v1/models", headers=auth_headers(api_key)
        ) as resp:
            resp.raise_for_status()
            models = (await resp.json())["data"]
    if not models:
        raise ValueError(f"{base_url}/v1/models lists no model; pass --model")
    return models[0]["id"]


async def benchmark(
    base_url: str,
    endpoint: str,
    model: str,
    prompts: list[str],
    request_rate: float,
    max_tokens: int,
    seed: int,
    max_concurrency: int | None = None,
    api_key: str | None = None,
    ignore_eos: bool = True,
    label: str | None = None,
) -> dict:
    """Stream one request per prompt at Poisson arrivals; the summary dict (see `format_table`)."""
    if endpoint not in (COMPLETIONS, CHAT):
        raise ValueError(f"endpoint must be {COMPLETIONS} or {CHAT}, got {endpoint!r}")
    if not prompts:
        raise ValueError("prompts must not be empty")
    if not request_rate > 0:
        raise ValueError(f"request_rate must be > 0 (inf: all at once), got {request_rate}")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1 or None, got {max_concurrency}")
    url = base_url.rstrip("/") + endpoint
    headers = auth_headers(api_key)
    offsets = arrival_offsets(len(prompts), request_rate, seed)
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    # limit=0: aiohttp's default pool of 100 connections would silently cap concurrency.
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    spec_before = await fetch_spec_counters(base_url, headers)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        start = time.perf_counter()

        async def arrive(prompt: str, offset: float) -> RequestResult:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            async with gate:
                payload = build_payload(endpoint, model, prompt, max_tokens, ignore_eos)
                return await send_request(session, url, payload, headers)

        results = await asyncio.gather(*(arrive(p, o) for p, o in zip(prompts, offsets)))
        duration = time.perf_counter() - start
    spec = spec_summary(spec_before, await fetch_spec_counters(base_url, headers))
    return {
        "label": label or base_url,
        "base_url": base_url,
        "endpoint": endpoint,
        "model": model,
        "num_prompts": len(prompts),
        # A string, as vLLM writes it: JSON has no infinity.
        "request_rate": "inf" if math.isinf(request_rate) else request_rate,
        "max_concurrency": max_concurrency,
        "max_tokens": max_tokens,
        "ignore_eos": ignore_eos,
        **summarize(results, duration),
        **spec,
    }


def format_table(results: list[dict]) -> str:
    """Results side by side, one column per label."""
    labels = [r["label"] for r in results]
    name_width = max(len(title) for title, _, _ in TABLE_ROWS)
    col_width = max([12, *map(len, labels)]) + 2
    header = "Metric".ljust(name_width) + "".join(label.rjust(col_width) for label in labels)
    lines = [header, "-" * len(header)]
    for title, key, fmt in TABLE_ROWS:
        lines.append(
            title.ljust(name_width) + "".join(format(r[key], fmt).rjust(col_width) for r in results)
        )
    if all("spec_decode_num_drafts" in r for r in results):
        lines += spec_table_lines(results, name_width, col_width, len(header))
    return "\n".join(lines)


def add_bench_serve_args(parser: argparse.ArgumentParser) -> None:
    """`vllm bench serve`'s flags, those pdserve supports."""
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--endpoint", default=COMPLETIONS, choices=[COMPLETIONS, CHAT])
    parser.add_argument("--model", default=None, help="default: the first model at /v1/models")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests/s with Poisson arrivals; inf (default): all at once",
    )
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="generate exactly --max-tokens per request",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument(
        "--label", default=None, help="column name in the table (default: the base URL)"
    )
    parser.add_argument("--result-json", default=None, metavar="PATH")
    parser.add_argument("--api-key", default=None)


def run_bench_serve(args: argparse.Namespace) -> dict:
    """Run the benchmark the flags describe, print its table (and first errors), write --result-json."""
    model = args.model or asyncio.run(fetch_model(args.base_url, args.api_key))
    result = asyncio.run(
        benchmark(
            args.base_url,
            args.endpoint,
            model,
            sample_prompts(args.num_prompts),
            args.request_rate,
            args.max_tokens,
            args.seed,
            args.max_concurrency,
            args.api_key,
            args.ignore_eos,
            args.label,
        )
    )
    print(format_table([result]))
    for error in result["errors"][:MAX_ERRORS_SHOWN]:
        print(f"error: {error}")
    if args.result_json:
        Path(args.result_json).write_text(json.dumps(result, indent=2) + "\n")
    return result
