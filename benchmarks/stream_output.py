"""Front-end cost of one streaming completion: AsyncLLM, detokenizer, metrics and the SSE layer.

A fake engine core feeds one token per step (no model, no engine process), and the
OpenAI server's completion stream turns each step into an SSE event. The CPU time of the
whole stream, per token, should not grow with the stream's length.

Usage: python benchmarks/stream_output.py [--tokens 500 1000 2000] [--repeats 3] [--logprobs N]
Prints a table and a final JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pdserve.engine.async_llm as async_llm_module  # noqa: E402
from pdserve.config import EngineConfig  # noqa: E402
from pdserve.engine.async_llm import AsyncLLM  # noqa: E402
from pdserve.engine.messages import EngineCoreOutputs, EngineCoreRequest  # noqa: E402
from pdserve.entrypoints.openai.serving import OpenAIServing  # noqa: E402
from pdserve.entrypoints.openai.serving_completion import OpenAIServingCompletion  # noqa: E402
from pdserve.outputs import EngineCoreOutput, LogprobsLists  # noqa: E402
from pdserve.protocol.completion import CompletionRequest  # noqa: E402
from pdserve.request import FinishReason  # noqa: E402


class FakeEngineCore:
    """Stands in for AsyncEngineCoreClient: each added request gets one token per step."""

    dead_reason: str | None = None

    def __init__(self, config: EngineConfig) -> None:
        self.vocab_size = config.model_config.vocab_size
        self.on_outputs: Callable[[EngineCoreOutputs], None] | None = None
        self.tasks: list[asyncio.Task[None]] = []

    def start(self, on_outputs: Callable[[EngineCoreOutputs], None], on_dead: object) -> None:
        self.on_outputs = on_outputs

    def add_request(self, request: EngineCoreRequest) -> None:
        self.tasks.append(asyncio.get_running_loop().create_task(self.run(request)))

    def abort_requests(self, request_ids: list[str]) -> None:
        pass

    def shutdown(self) -> None:
        pass

    async def run(self, request: EngineCoreRequest) -> None:
        assert self.on_outputs is not None
        params = request.sampling_params
        num_tokens = params.max_tokens or 16
        k = params.logprobs
        for step in range(num_tokens):
            token = 3 + (step * 7) % (self.vocab_size - 3)  # past the special tokens
            logprobs = None
            if k is not None:
                ids = [token] + [3 + (token + j) % (self.vocab_size - 3) for j in range(1, k + 1)]
                logprobs = LogprobsLists([ids], [[-0.5 - j for j in range(k + 1)]], [1])
            last = step == num_tokens - 1
            output = EngineCoreOutput(
                request.request_id,
                [token],
                logprobs,
                finish_reason=int(FinishReason.LENGTH) if last else None,
            )
            self.on_outputs(EngineCoreOutputs(time.time(), [output]))
            await asyncio.sleep(0)  # the stream's consumer runs between steps


async def one_stream(serving: OpenAIServing, fake: FakeEngineCore, n: int, logprobs: int | None):
    req = CompletionRequest(
        prompt="Once upon a time", max_tokens=n, stream=True, ignore_eos=True, logprobs=logprobs
    )
    events = 0
    start = time.process_time()
    async for _ in OpenAIServingCompletion(serving).completion_stream(
        req, f"bench-{n}-{time.monotonic_ns()}"
    ):
        events += 1
    await asyncio.gather(*fake.tasks)
    return time.process_time() - start, events


async def run(args: argparse.Namespace, model: str) -> list[dict]:
    config = EngineConfig.from_engine_args(model=model, max_model_len=max(args.tokens) + 64)
    async_llm_module.AsyncEngineCoreClient = FakeEngineCore  # no engine process
    engine = AsyncLLM(config)
    await engine.start()
    fake = engine.client
    serving = OpenAIServing(engine, config.model_config.name, None)
    rows = []
    for n in args.tokens:
        cpu = []
        for _ in range(args.repeats):
            seconds, events = await one_stream(serving, fake, n, args.logprobs)
            assert events >= n, f"{events} events for {n} tokens"
            cpu.append(seconds)
        median = statistics.median(cpu)
        rows.append({"tokens": n, "cpu_ms": median * 1e3, "us_per_token": median / n * 1e6})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="a model folder (its tokenizer is used)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[500, 1000, 2000])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--logprobs", type=int, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from tests.utils.tiny_models import make_tiny_model

            model = str(make_tiny_model("llama", Path(tmp) / "tiny", max_position_embeddings=4096))
        rows = asyncio.run(run(args, model))
    print(f"{'tokens':>8}{'CPU per stream (ms)':>22}{'CPU per token (us)':>22}")
    for row in rows:
        print(f"{row['tokens']:>8}{row['cpu_ms']:>22.1f}{row['us_per_token']:>22.1f}")
    print(f"(median of {args.repeats} streams, logprobs={args.logprobs}; front end only)")
    growth = rows[-1]["us_per_token"] / rows[0]["us_per_token"]
    print(
        json.dumps(
            {
                "benchmark": "stream_output",
                "logprobs": args.logprobs,
                "rows": [
                    {k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}
                    for row in rows
                ],
                "per_token_growth": round(growth, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
