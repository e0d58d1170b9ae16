"""The serving benchmark client against a small OpenAI-compatible streaming peer run in the test.

The peer streams two tokens per chunk and reports the true count in a final usage chunk, so token
totals show whether the client reads usage or counts chunks. One prompt gets a 500, another a
stream without usage (the client must fall back to counting chunks).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from pdserve.entrypoints import bench_serve
from pdserve.entrypoints.bench_serve import (
    CHAT,
    COMPLETIONS,
    RequestResult,
    add_bench_serve_args,
    arrival_offsets,
    benchmark,
    build_payload,
    format_table,
    run_bench_serve,
    send_request,
)

MODEL = "fake-model"
FAIL_PROMPT = "please fail"
NO_USAGE_PROMPT = "no usage please"
CHUNK_DELAY_S = 0.003
TOKENS_PER_CHUNK = 2


class FakeServer:
    """Records what it was sent and how many requests were in flight at once."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        self.in_flight = 0
        self.peak_in_flight = 0
        # Speculation's counters on /metrics (404 while off), as a pdserve server exports them:
        # each request adds 2 drafts of 3 tokens, 4 accepted (2 at position 0, 1 at 1 and 2).
        self.speculating = False
        self.num_requests = 0

    async def metrics(self, request: web.Request) -> web.Response:
        if not self.speculating:
            return web.Response(status=404)
        n = self.num_requests
        lines = [
            "# TYPE pdserve:spec_decode_num_drafts counter",
            f'pdserve:spec_decode_num_drafts_total{{model_name="m"}} {2 * n + 10}',
            "# TYPE pdserve:spec_decode_num_draft_tokens counter",
            f'pdserve:spec_decode_num_draft_tokens_total{{model_name="m"}} {6 * n + 30}',
            "# TYPE pdserve:spec_decode_num_accepted_tokens counter",
            f'pdserve:spec_decode_num_accepted_tokens_total{{model_name="m"}} {4 * n + 20}',
            "# TYPE pdserve:spec_decode_num_accepted_tokens_per_pos counter",
        ] + [
            f'pdserve:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="{i}"}}'
            f" {per * n + 5}"
            for i, per in enumerate((2, 1, 1))
        ]
        return web.Response(text="\n".join(lines) + "\n")

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.num_requests += 1
        prompt = body["prompt"] if "prompt" in body else body["messages"][-1]["content"]
        if prompt == FAIL_PROMPT:
            return web.json_response({"error": {"message": "boom"}}, status=500)
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            return await self._stream(request, body, prompt)
        finally:
            self.in_flight -= 1

    async def _stream(self, request: web.Request, body: dict, prompt: str) -> web.StreamResponse:
        chat = "messages" in body
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def send(chunk: dict) -> None:
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())

        if chat:  # as OpenAI: the first chat chunk carries the role and no text
            await send({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        await resp.write(b": keep-alive\n\n")
        for _ in range(body["max_tokens"] // TOKENS_PER_CHUNK):
            await asyncio.sleep(CHUNK_DELAY_S)
            text = "ab" * TOKENS_PER_CHUNK
            choice = (
                {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
            )
            await send({"choices": [choice]})
        if body.get("stream_options", {}).get("include_usage") and prompt != NO_USAGE_PROMPT:
            prompt_tokens = len(prompt.split())
            usage = {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": body["max_tokens"],
                "total_tokens": prompt_tokens + body["max_tokens"],
            }
            await send({"choices": [], "usage": usage})
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


@pytest.fixture
def server() -> Iterator[tuple[FakeServer, str]]:
    """(fake, base_url); its own loop in a thread, so synchronous code (run_bench_serve) can call it."""
    fake = FakeServer()
    app = web.Application()
    app.router.add_get("/v1/models", fake.models)
    app.router.add_get("/metrics", fake.metrics)
    app.router.add_post(COMPLETIONS, fake.generate)
    app.router.add_post(CHAT, fake.generate)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", 0).start())
    host, port = runner.addresses[0][:2]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield fake, f"http://{host}:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


def assert_latencies_sane(result: dict) -> None:
    for name in ("ttft", "itl", "e2el"):
        assert 0 < result[f"p50_{name}_ms"] <= result[f"p90_{name}_ms"] <= result[f"p99_{name}_ms"]
    assert result["mean_ttft_ms"] < result["mean_e2el_ms"]
    assert result["p99_ttft_ms"] <= result["p99_e2el_ms"]


@pytest.mark.parametrize("endpoint", [COMPLETIONS, CHAT])
def test_counts_tokens_and_failures(server: tuple[FakeServer, str], endpoint: str) -> None:
    fake, url = server
    prompts = ["hello there"] * 6 + [FAIL_PROMPT, NO_USAGE_PROMPT]
    max_tokens = 8
    result = asyncio.run(benchmark(url, endpoint, MODEL, prompts, float("inf"), max_tokens, seed=0))

    assert (result["completed"], result["failed"]) == (7, 1)
    [error] = result["errors"]
    assert error.startswith("HTTP 500") and "boom" in error
    # Six from usage; the one without usage counts its chunks.
    assert result["total_output_tokens"] == 6 * max_tokens + max_tokens // TOKENS_PER_CHUNK
    assert result["total_input_tokens"] == 6 * 2
    assert result["output_throughput"] == pytest.approx(
        result["total_output_tokens"] / result["duration"]
    )
    assert_latencies_sane(result)
    for body in fake.bodies:
        assert body["stream"] and body["stream_options"] == {"include_usage": True}
        assert body["temperature"] == 0 and body["ignore_eos"] is True and body["model"] == MODEL


@pytest.mark.parametrize("endpoint", [COMPLETIONS, CHAT])
def test_ttft_waits_for_text(server: tuple[FakeServer, str], endpoint: str) -> None:
    """The role-only chat chunk and the keep-alive comment come before the first text: the
    first text chunk ends the TTFT, each later one adds an inter-token gap."""
    _, url = server
    max_tokens = 8

    async def one() -> RequestResult:
        async with aiohttp.ClientSession() as session:
            payload = build_payload(endpoint, MODEL, "hello there", max_tokens, True)
            return await send_request(session, url + endpoint, payload, {})

    result = asyncio.run(one())
    assert result.ok and result.output_tokens == max_tokens
    assert 0 < result.ttft <= result.latency
    assert len(result.itl) == max_tokens // TOKENS_PER_CHUNK - 1


class _Clock:
    """A perf_counter that advances one microsecond per reading: durations are positive and
    the benchmark's arithmetic is exact to within the readings it takes."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 1e-6
        return self.now


class _Sleeps:
    """asyncio, with a sleep that records how long it was asked to wait and only yields."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    def __getattr__(self, name: str) -> object:
        return getattr(asyncio, name)

    async def sleep(self, delay: float) -> None:
        self.delays.append(delay)
        await asyncio.sleep(0)


def test_requests_leave_at_poisson_offsets(
    server: tuple[FakeServer, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each request waits for its own arrival offset (measured by the benchmark's clock), so
    the send schedule is the Poisson process of `arrival_offsets`."""
    _, url = server
    num_prompts, rate, seed = 20, 50.0, 1
    sleeps = _Sleeps()
    monkeypatch.setattr(bench_serve, "asyncio", sleeps)
    monkeypatch.setattr(bench_serve, "time", _Clock())
    result = asyncio.run(benchmark(url, COMPLETIONS, MODEL, ["x"] * num_prompts, rate, 4, seed))
    assert result["completed"] == num_prompts
    # Every request asked to wait until start + its offset; the clock moved a few readings.
    offsets = arrival_offsets(num_prompts, rate, seed)
    assert sorted(sleeps.delays) == pytest.approx(offsets, abs=1e-3)


def test_arrival_offsets_are_a_poisson_process() -> None:
    offsets = arrival_offsets(4000, 50.0, seed=3)
    gaps = [b - a for a, b in zip(offsets, offsets[1:])]
    assert offsets[0] == 0.0 and all(g > 0 for g in gaps)
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 50.0, rel=0.05)
    assert offsets == arrival_offsets(4000, 50.0, seed=3)  # the seed fixes the schedule
    assert arrival_offsets(5, float("inf"), seed=3) == [0.0] * 5


def test_concurrency_limit(server: tuple[FakeServer, str]) -> None:
    fake, url = server
    result = asyncio.run(
        benchmark(
            url,
            COMPLETIONS,
            MODEL,
            ["x"] * 8,
            float("inf"),
            4,
            seed=1,
            max_concurrency=2,
            ignore_eos=False,
        )
    )
    assert result["completed"] == 8 and fake.peak_in_flight <= 2
    assert "ignore_eos" not in fake.bodies[-1]


def test_run_bench_serve_writes_json_and_table(
    server: tuple[FakeServer, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, url = server
    parser = argparse.ArgumentParser()
    add_bench_serve_args(parser)
    out = tmp_path / "result.json"
    args = parser.parse_args(
        [
            "--base-url",
            url,
            "--num-prompts",
            "40",
            "--max-tokens",
            "4",
            "--label",
            "fake",
            "--result-json",
            str(out),
        ]
    )
    result = run_bench_serve(args)

    assert result["model"] == MODEL  # asked /v1/models
    assert (result["completed"], result["failed"]) == (40, 0)
    assert result["request_rate"] == "inf"
    assert json.loads(out.read_text()) == result
    printed = capsys.readouterr().out
    assert "fake" in printed and "P99 TTFT (ms)" in printed


def test_format_table_side_by_side(server: tuple[FakeServer, str]) -> None:
    _, url = server

    async def both() -> list[dict]:
        return [
            await benchmark(
                url, COMPLETIONS, MODEL, ["a b"] * 4, float("inf"), 4, 0, label="prefill-heavy"
            ),
            await benchmark(url, CHAT, MODEL, ["a b"] * 4, float("inf"), 4, 0, label="decode"),
        ]

    table = format_table(asyncio.run(both()))
    lines = table.splitlines()
    assert lines[0].split()[1:] == ["prefill-heavy", "decode"]
    assert len({len(line) for line in lines}) == 1  # columns aligned
    successful = next(line for line in lines if line.startswith("Successful requests"))
    assert successful.split()[-2:] == ["4", "4"]


def test_speculative_decoding_summary_from_the_servers_counters(
    server: tuple[FakeServer, str],
) -> None:
    """vLLM's section: what the server's counters gained over the run (not their totals)."""
    fake, url = server
    fake.speculating = True
    result = asyncio.run(benchmark(url, COMPLETIONS, MODEL, ["a b"] * 5, float("inf"), 4, 0))
    assert result["spec_decode_num_drafts"] == 10
    assert result["spec_decode_num_draft_tokens"] == 30
    assert result["spec_decode_num_accepted_tokens"] == 20
    assert result["spec_decode_acceptance_rate"] == pytest.approx(100 * 20 / 30)
    assert result["spec_decode_acceptance_length"] == pytest.approx(3.0)
    assert result["spec_decode_per_position_acceptance_rate"] == [100.0, 50.0, 50.0]
    table = format_table([result])
    assert "Speculative Decoding" in table
    assert next(line for line in table.splitlines() if line.startswith("Acceptance length"))
    assert "Position 2 acceptance (%)" in table
    fake.speculating = False
    plain = asyncio.run(benchmark(url, COMPLETIONS, MODEL, ["a b"], float("inf"), 4, 0))
    assert "spec_decode_num_drafts" not in plain
    assert "Speculative Decoding" not in format_table([plain])
