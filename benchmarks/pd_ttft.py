"""Time to first token through a split deployment against one instance (issue 14's setup).

Three measurements, one after the other on the same machine, single and proxy over the same
--requests distinct prompts of --prompt-len token ids (no prefix is shared), by hand over as many
others (the proxy's run left its prompts in the prefill instance's prefix cache), streaming,
--max-tokens tokens, one request at a time after --warmup requests:
- single: `pdserve serve`, the client's first token;
- proxy: `pdserve launch` (1 prefill, 1 decode, the proxy), the client's first token;
  with the medians of the parts its Server-Timing header gives;
- by hand: the prefill instance of that launch (its one-token hop, timed), then the decode
  instance with the returned kv_transfer_params, streaming: its first token after its request
  was sent (the shipped token: it waits for no transfer).
Prints medians and p90s, the ratio proxy / single, and one JSON line. The client sets
TCP_NODELAY: httpx's synchronous client writes a request's headers and body in two sends, and
Nagle's algorithm holds the second until the server's delayed ACK (40 ms on Linux), which would
add 40 ms to every figure here (asyncio clients, the proxy's among them, set it already).

Usage: python benchmarks/pd_ttft.py [--model tiny|default|PATH] [--requests 10] [--warmup 2]
       [--prompt-len 380] [--max-tokens 16] [-- flags for every instance]
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from serving import launch_server, stop_server, wait_healthy  # noqa: E402
from throughput import resolve_model  # noqa: E402

from pdserve.config import ModelConfig  # noqa: E402
from pdserve.utils import get_open_port  # noqa: E402
from tests.utils.pd import greedy_body  # noqa: E402

CLIENT = httpx.Client(
    timeout=300,
    transport=httpx.HTTPTransport(socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]),
)


def _prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def _server_timing(header: str) -> dict[str, float]:
    """{name: ms} of a Server-Timing header."""
    parts = {}
    for entry in filter(None, (e.strip() for e in header.split(","))):
        name, *params = entry.split(";")
        durations = [p.split("=", 1)[1] for p in params if p.strip().startswith("dur=")]
        if durations:
            parts[name] = float(durations[0])
    return parts


TIMINGS: list[dict[str, float]] = []  # the proxy's Server-Timing of each request


def _first_token_ms(url: str, body: dict[str, Any]) -> float:
    """Milliseconds from sending a streaming request to its first chunk with a token; the rest
    is read too, so that the next request runs alone."""
    start, first = time.perf_counter(), None
    with CLIENT.stream("POST", f"{url}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        if "server-timing" in resp.headers:
            TIMINGS.append(_server_timing(resp.headers["server-timing"]))
        for line in resp.iter_lines():
            if first is not None or not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line.removeprefix("data: "))["choices"]
            if choices and (choices[0].get("token_ids") or choices[0].get("text")):
                first = (time.perf_counter() - start) * 1000
    if first is None:
        raise RuntimeError("the stream ended without a token")
    return first


def _body(model: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    return {**greedy_body(model, prompt, max_tokens), "stream": True}


def _served_model(url: str) -> str:
    return CLIENT.get(f"{url}/v1/models").json()["data"][0]["id"]


def _summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "median_ms": round(statistics.median(ordered), 1),
        "p90_ms": round(ordered[int(0.9 * (len(ordered) - 1))], 1),
    }


def _by_hand(prefill: str, decode: str, model: str, prompt: list[int], max_tokens: int) -> tuple:
    hop = {
        **_body(model, prompt, 1),
        "stream": False,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    start = time.perf_counter()
    resp = CLIENT.post(f"{prefill}/v1/completions", json=hop)
    resp.raise_for_status()
    prefill_ms = (time.perf_counter() - start) * 1000
    body = {
        **_body(model, prompt, max_tokens),
        "kv_transfer_params": resp.json()["kv_transfer_params"],
    }
    return prefill_ms, _first_token_ms(decode, body)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--requests", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=380)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("instance_args", nargs="*", help="after --: flags for every instance")
    args = parser.parse_args()
    model_path = resolve_model(args.model, Path(tempfile.mkdtemp()))
    instance_args = ["--model", model_path, *(args.instance_args or ["--dtype", "float32"])]
    vocab = ModelConfig(model=model_path).vocab_size
    count = args.warmup + args.requests
    every = _prompts(2 * count, args.prompt_len, vocab)
    prompts, hand_prompts = every[:count], every[count:]
    results: dict[str, list[float]] = {}

    def measure(command: str, extra: list[str]) -> None:
        port = get_open_port()
        url = f"http://127.0.0.1:{port}"
        proc = launch_server(port, [*extra, *instance_args], command)
        try:
            wait_healthy(proc, url)
            model = _served_model(url)
            times = [_first_token_ms(url, _body(model, p, args.max_tokens)) for p in prompts]
            results["single" if command == "serve" else "proxy"] = times[args.warmup :]
            for name in TIMINGS[0] if command == "launch" else ():
                results[f"  Server-Timing {name}"] = [t[name] for t in TIMINGS[args.warmup :]]
            if command == "launch":
                health = CLIENT.get(f"{url}/health").json()
                prefill, decode = health["prefill"][0]["url"], health["decode"][0]["url"]
                hand = [_by_hand(prefill, decode, model, p, args.max_tokens) for p in hand_prompts]
                results["by hand: prefill hop"] = [h[0] for h in hand[args.warmup :]]
                results["by hand: decode first token"] = [h[1] for h in hand[args.warmup :]]
        finally:
            stop_server(proc)

    measure("serve", [])
    measure("launch", [])
    summary = {name: _summary(values) for name, values in results.items()}
    print(f"{'':30s} {'median ms':>10s} {'p90 ms':>10s}")
    for name, s in summary.items():
        print(f"{name:30s} {s['median_ms']:10.1f} {s['p90_ms']:10.1f}")
    ratio = summary["proxy"]["median_ms"] / summary["single"]["median_ms"]
    print(
        f"TTFT proxy / single: {ratio:.2f}x (median of {args.requests} after {args.warmup} warm-ups)"
    )
    print(json.dumps({"benchmark": "pd_ttft", "model": args.model, "prompt_len": args.prompt_len,
                      "max_tokens": args.max_tokens, "ratio": round(ratio, 3), **summary}))  # fmt: skip


if __name__ == "__main__":
    main()
