"""The main job: one prefill instance, one decode instance and the proxy, answering chat prompts.

Starts `pdserve launch` (default model unless --model), sends a few chat prompts through the
proxy with the official openai client, prints each answer and the KV cache the prefill instance
handed over (blocks, bytes, milliseconds, from the decode instance's metrics), then stops
everything. Run: `make demo`, or `python examples/pd_demo.py [--model M] [-- extra serve flags]`.
"""

from __future__ import annotations

import argparse
import re
import signal
import subprocess
import sys
import time

import httpx
import openai

PROMPTS = [
    "What is the capital of Germany?",
    "Name three primary colors.",
    "Write one sentence about the ocean.",
]


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    match = re.search(rf"^pdserve:{name}{{[^}}]*}} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-tokens", type=int, default=48)
    args, extra = parser.parse_known_args()
    cmd = [
        sys.executable,
        "-m",
        "pdserve.entrypoints.cli",
        "launch",
        "--port",
        str(args.port),
        # Every prompt through the split, short as these are: by default the proxy lets the
        # decode instance prefill a prompt this short itself (docs/proxy.md).
        "--pd-min-uncached-tokens",
        "0",
        *(["--model", args.model] if args.model else []),
        *[a for a in extra if a != "--"],
    ]
    print("$", " ".join(cmd[2:]), flush=True)
    launch = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        assert launch.stdout is not None
        for line in launch.stdout:  # the launcher prints its endpoint once every part is healthy
            print(line, end="", flush=True)
            if "serving" in line:
                break
        if launch.poll() is not None:
            print("the deployment failed to start", file=sys.stderr)
            return 1
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{args.port}/v1", api_key="none", max_retries=0
        )
        model = client.models.list().data[0].id
        seen: dict[str, tuple[float, float]] = {}  # decode url -> (bytes, seconds) before
        for prompt in PROMPTS:
            start = time.perf_counter()
            raw = client.chat.completions.with_raw_response.create(
                model=model,
                messages=[{"role": "user", "content": prompt}],
                max_tokens=args.max_tokens,
                temperature=0,
            )
            elapsed = time.perf_counter() - start
            decode_url = raw.headers["x-pd-decode-instance"]
            answer = raw.parse()
            print(f"\nPrompt: {prompt}\nAnswer: {answer.choices[0].message.content.strip()}")
            print(f"  X-PD-Path: {raw.headers['x-pd-path']}")
            # A fresh deployment and one request at a time: the counters' deltas are this request's.
            now = (
                metric(decode_url, "kv_transfer_bytes_total"),
                metric(decode_url, "kv_transfer_seconds_total"),
            )
            before = seen.get(decode_url, (0.0, 0.0))
            seen[decode_url] = now
            # The decode side reads only the blocks its prefix cache lacks (a shared system prompt).
            print(
                f"  KV handed over: {raw.headers['x-pd-kv-blocks']} blocks held by prefill, "
                f"{(now[0] - before[0]) / 2**10:.0f} KiB read by decode in {(now[1] - before[1]) * 1e3:.1f} ms "
                f"(request {elapsed * 1e3:.0f} ms, {answer.usage.completion_tokens} tokens)"
            )
        return 0
    finally:
        launch.send_signal(signal.SIGTERM)
        try:
            launch.wait(60)
        except subprocess.TimeoutExpired:
            launch.kill()
        print("\ndeployment stopped", flush=True)


if __name__ == "__main__":
    sys.exit(main())
