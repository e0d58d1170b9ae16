"""Where a short prompt is better prefilled on its decode instance than handed over: the measure
behind `--pd-min-uncached-tokens`'s default.

One `pdserve launch` (1P1D, as users start it) with a proxy that always hands over, and a second
proxy over the same instances that never does. For each prompt length, fresh random prompts
(nothing cached) go through both, alternating; printed per length: the median time to the
first token, to the second (the handover's pull is waited for there), and to the last of
`--max-tokens`, both ways, and their ratio.

Usage: python benchmarks/pd_min_uncached.py [--lengths 4 8 16 32 64 128] [--reps 7]
       [-- flags for every instance, e.g. --model M --dtype float32]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from serving import launch_server, stop_server, wait_healthy  # noqa: E402

from pdserve.utils import get_open_port  # noqa: E402


def timed_stream(url: str, model: str, prompt: list[int], max_tokens: int) -> tuple[float, ...]:
    """Seconds to the first token, the second and the last of one streamed request."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    start = time.perf_counter()
    stamps = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                stamps.append(time.perf_counter() - start)
    return stamps[0], stamps[1], stamps[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4, 8, 16, 32, 64, 128])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--max-tokens", type=int, default=8)
    args, instance_args = parser.parse_known_args()
    instance_args = [a for a in instance_args if a != "--"]
    port = get_open_port()
    remote = f"http://127.0.0.1:{port}"
    launch = launch_server(port, ["--pd-min-uncached-tokens", "0", *instance_args], "launch")
    local_proc = None
    try:
        wait_healthy(launch, remote)
        health = httpx.get(f"{remote}/health").json()
        addresses = {
            role: [i["url"].removeprefix("http://") for i in health[role]]
            for role in ("prefill", "decode")
        }
        local_port = get_open_port()
        local = f"http://127.0.0.1:{local_port}"
        local_proc = launch_server(
            local_port,
            ["--prefill", *addresses["prefill"], "--decode", *addresses["decode"],
             "--pd-min-uncached-tokens", "1000000"],
            "proxy",
        )  # fmt: skip
        wait_healthy(local_proc, local)
        model = httpx.get(f"{remote}/v1/models").json()["data"][0]["id"]
        info = httpx.get(f"http://{addresses['decode'][0]}/server_info?config_format=json").json()
        top = min(30000, info["vllm_config"]["model_config"]["vocab_size"])
        rng = random.Random(0)
        # Until the local proxy has the tokenizer (it needs the prompt's length): X-PD-Path says.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            probe = [rng.randrange(100, top) for _ in range(8)]
            r = httpx.post(f"{local}/v1/completions",
                           json={"model": model, "prompt": probe, "max_tokens": 1})  # fmt: skip
            if r.headers.get("X-PD-Path", "").endswith("policy"):
                break
            time.sleep(0.5)
        for _ in range(2):  # warm-up: handshakes, first allocations
            for url in (remote, local):
                timed_stream(url, model, [rng.randrange(100, top) for _ in range(64)], 4)
        rows = []
        for n in args.lengths:
            times: dict[str, list[tuple[float, ...]]] = {"remote": [], "local": []}
            for _ in range(args.reps):
                for name, url in (("remote", remote), ("local", local)):
                    prompt = [rng.randrange(100, top) for _ in range(n)]
                    times[name].append(timed_stream(url, model, prompt, args.max_tokens))
            med = {
                name: [statistics.median(t[i] for t in runs) * 1000 for i in range(3)]
                for name, runs in times.items()
            }
            rows.append(
                {"tokens": n, **{f"{k}_ms": [round(x, 1) for x in v] for k, v in med.items()}}
            )
            r, lo = med["remote"], med["local"]
            print(
                f"{n:>6} tokens | first {r[0]:7.1f} vs {lo[0]:7.1f} ms | second {r[1]:7.1f} vs "
                f"{lo[1]:7.1f} ms | last {r[2]:7.1f} vs {lo[2]:7.1f} ms | local/remote to 2nd "
                f"{lo[1] / r[1]:.2f}x",
                flush=True,
            )
        print("(remote: handed over, vs local: prefilled on the decode instance; medians of "
              f"{args.reps})")  # fmt: skip
        print(json.dumps({"min_uncached": rows}))
    finally:
        if local_proc is not None:
            stop_server(local_proc)
        stop_server(launch)


if __name__ == "__main__":
    main()
