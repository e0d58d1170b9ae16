"""Push mode against pull mode on the same deployment shape, at a decode-side prefix hit of 0%,
50% and 100% (issue 17): TTFT and KV bytes moved, side by side.

Two `pdserve launch` deployments run at once (1 prefill, 1 decode, the proxy; one with
`--kv-mode pull`, NixlConnector, one with `--kv-mode push`, NixlPushConnector), every prompt
through the prefill leg (--pd-min-uncached-tokens 0). For each hit level and request, a fresh
prompt of --prompt-len token ids (the prefill instance never has it cached); for a hit of X%,
its first X% is computed on the decode instance beforehand (a request sent to it directly),
identically in both deployments. Requests alternate between the deployments, one at a time,
streaming --max-tokens tokens: TTFT is the client's first token through the proxy; bytes moved
are the decode instance's kv_transfer_bytes_total delta. An idle deployment costs no CPU
(DESIGN.md invariant 5), so the other runs as if alone. The client sets TCP_NODELAY
(pd_ttft.py says why).

Usage: python benchmarks/pd_push.py [--model default|tiny|PATH] [--requests 8] [--warmup 2]
       [--prompt-len 512] [--max-tokens 8] [--transport nixl] [-- flags for every instance]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from pd_ttft import CLIENT, _first_token_ms, _served_model, _summary  # noqa: E402
from serving import launch_server, stop_server, wait_healthy  # noqa: E402
from throughput import resolve_model  # noqa: E402

from pdserve.config import ModelConfig  # noqa: E402
from pdserve.utils import get_open_port  # noqa: E402
from tests.utils.pd import greedy_body  # noqa: E402
from tests.utils.server import MetricsReader  # noqa: E402

MODES = ("pull", "push")
HITS = (0, 50, 100)


class Deployment:
    def __init__(self, mode: str, instance_args: list[str], transport: str) -> None:
        self.mode = mode
        self.port = get_open_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = ["--kv-mode", mode, "--transport", transport, "--pd-min-uncached-tokens", "0"]
        self.proc = launch_server(self.port, [*args, *instance_args], "launch")

    def start(self) -> None:
        wait_healthy(self.proc, self.url)
        health = CLIENT.get(f"{self.url}/health").json()
        self.decode = health["decode"][0]["url"]
        self.model = _served_model(self.url)
        self.metrics = MetricsReader(self.decode)

    def warm(self, prefix: list[int]) -> None:
        """Compute `prefix` on the decode instance alone (it stays in its prefix cache)."""
        body = {**greedy_body(self.model, prefix, 1)}
        CLIENT.post(f"{self.decode}/v1/completions", json=body).raise_for_status()

    def request(self, prompt: list[int], max_tokens: int) -> tuple[float, float]:
        """(TTFT ms, KV bytes the decode instance received)."""
        before = self.metrics.metric("kv_transfer_bytes_total")
        body = {**greedy_body(self.model, prompt, max_tokens), "stream": True}
        ttft = _first_token_ms(self.url, body)
        return ttft, self.metrics.metric("kv_transfer_bytes_total") - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--transport", choices=["nixl", "ucx"], default="nixl")
    parser.add_argument("instance_args", nargs="*", help="after --: flags for every instance")
    args = parser.parse_args()
    model_path = resolve_model(args.model, Path(tempfile.mkdtemp()))
    instance_args = ["--model", model_path, *args.instance_args]
    vocab = ModelConfig(model=model_path).vocab_size
    rng = random.Random(0)
    deployments = {mode: Deployment(mode, instance_args, args.transport) for mode in MODES}
    results: dict[tuple[int, str], list[tuple[float, float]]] = {}
    try:
        for deployment in deployments.values():
            deployment.start()
        for hit in HITS:
            for i in range(args.warmup + args.requests):
                prompt = [rng.randrange(3, vocab) for _ in range(args.prompt_len)]
                prefix = prompt[: args.prompt_len * hit // 100]
                for mode in MODES if i % 2 == 0 else reversed(MODES):
                    deployment = deployments[mode]
                    if prefix:
                        deployment.warm(prefix)
                    measured = deployment.request(prompt, args.max_tokens)
                    if i >= args.warmup:
                        results.setdefault((hit, mode), []).append(measured)
    finally:
        for deployment in deployments.values():
            stop_server(deployment.proc)
    table: dict[str, Any] = {}
    print(
        f"{'decode-side hit':>15s} {'mode':>5s} {'TTFT p50 ms':>12s} {'p90 ms':>8s} {'KV KiB':>8s}"
    )
    for hit in HITS:
        for mode in MODES:
            ttfts = [m[0] for m in results[(hit, mode)]]
            kib = sorted(m[1] / 1024 for m in results[(hit, mode)])[len(ttfts) // 2]
            s = _summary(ttfts)
            table[f"{hit}%-{mode}"] = {**s, "kv_kib": round(kib, 1)}
            print(f"{hit:>14d}% {mode:>5s} {s['median_ms']:12.1f} {s['p90_ms']:8.1f} {kib:8.1f}")
        ratio = table[f"{hit}%-pull"]["median_ms"] / table[f"{hit}%-push"]["median_ms"]
        table[f"{hit}%-pull/push"] = round(ratio, 2)
        print(f"{'':>15s} TTFT pull / push: {ratio:.2f}x")
    print(json.dumps({"benchmark": "pd_push", "model": args.model, "prompt_len": args.prompt_len,
                      "transport": args.transport, **table}))  # fmt: skip


if __name__ == "__main__":
    main()
