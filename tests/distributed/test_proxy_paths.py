"""How the proxy served each request, told to the client (`X-PD-Path`) and counted
(`pdserve:proxy_requests_total`): remote through a prefill instance, or local (the decode
instance prefilled) with the reason; `--strict-pd` refuses the local path. pd_lessons 16.

Real instances (a prefill, a decode, and one without a KV connector standing in for a prefill
instance that cannot hand KV over), real `pdserve proxy` processes, the official client."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest

from pdserve.utils import get_open_port
from tests.utils.pd import greedy_body
from tests.utils.server import RemoteServer
from tests.utils.tiny_models import hf_greedy

PROMPT = [(i * 7) % 200 + 3 for i in range(40)]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def model(tiny_model: Callable[[str], str]) -> str:
    return tiny_model("llama")


@pytest.fixture(scope="module")
def reference(model: str) -> list[int]:
    return hf_greedy(Path(model), [PROMPT], MAX_TOKENS)[0]


@pytest.fixture(scope="module")
def servers(pd_instances: dict[str, RemoteServer]) -> dict[str, RemoteServer]:
    return pd_instances


@pytest.fixture(scope="module")
def split(servers: dict[str, RemoteServer]) -> Iterator[RemoteServer]:
    """A proxy in front of the prefill and the decode instance, for the tests that share it
    (they read its counters as differences)."""
    with _proxy(servers["prefill"].url.removeprefix("http://"), servers["decode"]) as proxy:
        yield proxy
        assert proxy.stop() == []


def _proxy(prefill: str, decode: RemoteServer, *flags: str) -> RemoteServer:
    decode_address = decode.url.removeprefix("http://")
    # Every prompt through the prefill leg unless a test says otherwise: these test the split.
    args = ["proxy", "--prefill", prefill, "--decode", decode_address]
    return RemoteServer([*args, "--pd-min-uncached-tokens", "0", *flags])


def _complete(proxy: RemoteServer, model: str) -> tuple[str, list[int]]:
    raw = proxy.client().completions.with_raw_response.create(
        model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    return raw.headers["X-PD-Path"], raw.parse().choices[0].model_extra["token_ids"]


def _counted(proxy: RemoteServer, path: str, reason: str) -> float:
    return proxy.metric("proxy_requests_total", path=path, reason=reason)


def test_remote_path(
    servers: dict[str, RemoteServer], split: RemoteServer, model: str, reference: list[int]
) -> None:
    transfers = servers["decode"].metric("kv_transfers_total")
    counted = _counted(split, "remote", "none")
    assert _complete(split, model) == ("remote", reference)
    assert servers["decode"].metric("kv_transfers_total") == transfers + 1
    assert _counted(split, "remote", "none") == counted + 1


def test_a_batch_of_prompts_is_served_locally_and_told(
    servers: dict[str, RemoteServer], split: RemoteServer, model: str, reference: list[int]
) -> None:
    """A hand-off carries one prompt's KV: a batch's prompts are computed on the decode
    instance (before, each read the first prompt's hand-off). The decode instance itself
    refuses a batch with kv_transfer_params."""
    transfers = servers["decode"].metric("kv_transfers_total")
    raw = split.client().completions.with_raw_response.create(
        model=model, prompt=[PROMPT, PROMPT[:20]], max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert raw.headers["X-PD-Path"] == "local; reason=batch"
    choices = sorted(raw.parse().choices, key=lambda c: c.index)
    assert choices[0].model_extra["token_ids"] == reference
    assert servers["decode"].metric("kv_transfers_total") == transfers
    with pytest.raises(openai.BadRequestError) as e:
        servers["decode"].client().completions.create(
            model=model, prompt=[PROMPT, PROMPT], max_tokens=2,
            extra_body={"kv_transfer_params": {"do_remote_decode": True}},
        )  # fmt: skip
    assert e.value.body["param"] == "kv_transfer_params"


def test_prefill_without_kv_transfer_params_is_served_locally_and_told(
    servers: dict[str, RemoteServer], model: str, reference: list[int]
) -> None:
    with _proxy(servers["plain"].url.removeprefix("http://"), servers["decode"]) as proxy:
        transfers = servers["decode"].metric("kv_transfers_total")
        path, tokens = _complete(proxy, model)
        assert (path, tokens) == ("local; reason=no-kv-transfer-params", reference)
        assert servers["decode"].metric("kv_transfers_total") == transfers
        assert _counted(proxy, "local", "no-kv-transfer-params") == 1
        assert proxy.stop() == []


def test_unreachable_prefill_is_served_locally_and_told(
    servers: dict[str, RemoteServer], model: str, reference: list[int]
) -> None:
    with _proxy(f"127.0.0.1:{get_open_port()}", servers["decode"]) as proxy:
        # Refused at the first hop (or already marked down by the health check): either way local.
        first, tokens = _complete(proxy, model)
        assert tokens == reference
        assert first in ("local; reason=prefill-failed", "local; reason=prefill-unavailable")
        assert _complete(proxy, model) == ("local; reason=prefill-unavailable", reference)
        failed = _counted(proxy, "local", "prefill-failed")
        assert failed + _counted(proxy, "local", "prefill-unavailable") == 2
        assert proxy.stop() == []


def test_strict_pd_refuses_the_local_path(servers: dict[str, RemoteServer], model: str) -> None:
    plain = servers["plain"].url.removeprefix("http://")
    with _proxy(plain, servers["decode"], "--strict-pd") as proxy:
        with pytest.raises(openai.APIStatusError) as e:
            _complete(proxy, model)
        assert e.value.status_code == 503
        message = e.value.body["message"]
        assert "no-kv-transfer-params" in message and "--strict-pd" in message, message
        assert _counted(proxy, "local", "no-kv-transfer-params") == 1
        assert proxy.stop() == []


@pytest.mark.parametrize("stream", [True, False])
def test_server_timing_says_where_the_first_token_went(
    split: RemoteServer, model: str, reference: list[int], stream: bool
) -> None:
    """Its parts lie within the client's wait for the first token (how close they come to it
    is benchmarks/pd_ttft.py's to show); the proxy's /metrics keeps them as histograms. A
    stream's first token is the prefill instance's, sent before the decode leg: its parts are
    the proxy's and the prefill leg's, the decode instance's first byte only a histogram's."""
    proxy = split
    observed = {
        name: proxy.metric(f"pd_{name}_seconds_count")
        for name in ("prefill_leg", "decode_first_byte")
    }
    body = {**greedy_body(model, PROMPT, MAX_TOKENS), "stream": stream}
    start = time.perf_counter()
    with httpx.stream("POST", f"{proxy.url}/v1/completions", json=body, timeout=60) as resp:
        lines = resp.iter_lines()
        first = next(line for line in lines if line.strip())
        waited_ms = (time.perf_counter() - start) * 1000
        rest = [line for line in lines if line.startswith("data: ")]
    if stream:
        chunks = [json.loads(line.removeprefix("data: ")) for line in [first, *rest[:-1]]]
        assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == reference
    else:
        assert json.loads(first)["choices"][0]["token_ids"] == reference
    parts = {}
    for entry in resp.headers["Server-Timing"].split(", "):
        name, dur, desc = entry.split(";")
        assert desc.startswith('desc="')
        parts[name] = float(dur.removeprefix("dur="))
    expected = {"proxy", "prefill_leg"} | (set() if stream else {"decode_first_byte"})
    assert set(parts) == expected
    assert all(ms >= 0 for ms in parts.values()) and sum(parts.values()) <= waited_ms
    for name, count in observed.items():
        assert proxy.metric(f"pd_{name}_seconds_count") == count + 1


def _sse_tokens(resp: httpx.Response) -> tuple[list[int], list[str | None]]:
    tokens, reasons = [], []
    for line in resp.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            for choice in json.loads(line.removeprefix("data: "))["choices"]:
                tokens += choice.get("token_ids") or []
                reasons.append(choice.get("finish_reason"))
    return tokens, reasons


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("case", ["one token asked", "the first token stops"])
def test_no_decode_leg_when_the_prefill_answer_is_the_whole_answer(
    servers: dict[str, RemoteServer],
    split: RemoteServer,
    model: str,
    reference: list[int],
    case: str,
    stream: bool,
) -> None:
    body = greedy_body(model, PROMPT, MAX_TOKENS)
    if case == "one token asked":
        body["max_tokens"] = 1
    else:
        body["stop_token_ids"] = reference[:1]
    decode, proxy = servers["decode"], split
    counted = _counted(proxy, "prefill-only", "none")
    transfers = decode.metric("kv_transfers_total")
    with httpx.stream(
        "POST", f"{proxy.url}/v1/completions", json={**body, "stream": stream}, timeout=60
    ) as resp:
        assert resp.status_code == 200
        assert resp.headers["X-PD-Path"] == "prefill-only"
        if stream:
            tokens, reasons = _sse_tokens(resp)
        else:
            choice = json.loads(resp.read())["choices"][0]
            tokens, reasons = choice["token_ids"], [choice["finish_reason"]]
    assert tokens == reference[:1]
    assert reasons[-1] == ("length" if case == "one token asked" else "stop")
    assert decode.metric("kv_transfers_total") == transfers
    assert _counted(proxy, "prefill-only", "none") == counted + 1
    servers["prefill"].wait_pool_full()


def test_min_tokens_forbids_a_first_stop_through_the_split(
    servers: dict[str, RemoteServer], split: RemoteServer, model: str, reference: list[int]
) -> None:
    """The prefill hop keeps min_tokens (as 1): its first token is the one a single instance,
    which may not stop there, samples."""
    body = {**greedy_body(model, PROMPT, MAX_TOKENS), "stop_token_ids": reference[:1]}
    body["min_tokens"] = 2
    single = httpx.post(f"{servers['plain'].url}/v1/completions", json=body, timeout=60)
    expected = single.json()["choices"][0]["token_ids"]
    assert expected[0] != reference[0]
    resp = httpx.post(f"{split.url}/v1/completions", json=body, timeout=60)
    assert resp.headers["X-PD-Path"] == "remote"
    assert resp.json()["choices"][0]["token_ids"] == expected


def _events(url: str, endpoint: str, body: dict) -> list[dict]:
    """A stream's events, without what differs between two servers' answers (id, created)."""
    with httpx.stream("POST", f"{url}/v1/{endpoint}", json=body, timeout=60) as resp:
        assert resp.status_code == 200, resp.read()
        lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    for event in events:
        del event["id"], event["created"]
    return events


def _close(a: object, b: object) -> bool:
    """Equal, but floats (logprobs: two instances compute them) within 1e-4."""
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= 1e-4
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_a_stream_through_the_split_is_a_single_instance_stream(
    servers: dict[str, RemoteServer], split: RemoteServer, model: str, endpoint: str
) -> None:
    """The proxy sends the prefill instance's token as the stream's first events, the decode
    instance's stream follows without its own copy of them: event for event what one instance
    streams (chat's role chunk first), logprobs included, usage counting the token once."""
    body = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    if endpoint == "completions":
        body |= {"prompt": PROMPT, "logprobs": 2}
    else:
        messages = [{"role": "user", "content": "Say something long."}]
        body |= {"messages": messages, "logprobs": True, "top_logprobs": 2}
    single = _events(servers["plain"].url, endpoint, body)
    transfers = servers["decode"].metric("kv_transfers_total")
    through = _events(split.url, endpoint, body)
    assert servers["decode"].metric("kv_transfers_total") == transfers + 1
    assert len(through) == len(single) == MAX_TOKENS + 1 + (endpoint != "completions")
    assert _close(through, single), (through, single)


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_continuous_usage_through_the_split_counts_as_one_instance(
    servers: dict[str, RemoteServer], split: RemoteServer, model: str, endpoint: str
) -> None:
    """vLLM's stream_options.continuous_usage_stats: every chunk carries the usage so far, the
    proxy's own first-token chunks too; prompt and completion counts as one instance's."""
    body = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    body |= {
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    if endpoint == "completions":
        body["prompt"] = PROMPT
    else:
        body["messages"] = [{"role": "user", "content": "Say something long."}]

    def counts(url: str) -> list[tuple[int, int]]:
        events = _events(url, endpoint, body)
        assert all("usage" in e for e in events), events
        return [(e["usage"]["prompt_tokens"], e["usage"]["completion_tokens"]) for e in events]

    single, through = counts(servers["plain"].url), counts(split.url)
    assert through == single
    prompt = single[0][0]
    tokens = list(range(1, MAX_TOKENS + 1))
    role = [(prompt, 0)] if endpoint != "completions" else []
    assert single == role + [(prompt, n) for n in tokens] + [(prompt, MAX_TOKENS)]
