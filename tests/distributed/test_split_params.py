"""OpenAI parameters through the split (issue 14.4, pd_lessons 21), each against one instance.

n > 1: the proxy's prefill hop is one sequence, one hand-off; the decode instance's n sequences
share its one transfer (the others find its blocks in the prefix cache once it arrived), and
seeded outputs are a single instance's. logprobs: the first token's come from the prefill
instance with the token (it is shipped, not sampled again). echo: the prompt leads the text.
prompt_logprobs, and echo with logprobs: the prefill instance computes the prompt's, the proxy
puts them into the decode instance's answer. Real processes: a prefill and a decode instance,
`pdserve proxy` in front, and a plain `pdserve serve` as the reference."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from tests.utils.pd import greedy_body, split_proxy
from tests.utils.server import RemoteServer

BLOCK = 16
PROMPT_LEN = 2 * BLOCK + 8  # two full blocks the followers hit, 8 tokens they compute
MAX_TOKENS = 6
N = 3


def _prompt(salt: int) -> list[int]:
    """Prompts with different salts share no block: no test finds another's prefix cached."""
    return [salt + 5] + [(i * 13 + salt * 41) % 300 + 3 for i in range(PROMPT_LEN - 1)]


@pytest.fixture(scope="module")
def servers(
    tiny_model: Callable[[str], str], pd_instances: dict[str, RemoteServer]
) -> Iterator[dict[str, Any]]:
    with split_proxy(pd_instances["prefill"], pd_instances["decode"]) as proxy:
        yield {"model": tiny_model("llama"), **pd_instances, "proxy": proxy}


def _post(server: RemoteServer, body: dict[str, Any]) -> tuple[httpx.Headers, list[dict]]:
    """The response's headers and its choices by index; a stream's chunks joined per index."""
    if not body.get("stream"):
        resp = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        return resp.headers, sorted(resp.json()["choices"], key=lambda c: c["index"])
    choices: dict[int, dict] = {}
    headers, chunks = _stream_choices(server, body)
    for c in chunks:
        joined = choices.setdefault(c["index"], {"text": "", "token_ids": [], "lp": []})
        joined["text"] += c["text"]
        joined["token_ids"] += c["token_ids"]
        if c["logprobs"] is not None:
            lp = c["logprobs"]
            joined["lp"] += list(zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]))
    return headers, [choices[i] for i in sorted(choices)]


def _stream_choices(server: RemoteServer, body: dict[str, Any]) -> tuple[httpx.Headers, list]:
    """A streamed completion's headers and the choice chunks of its events, in order."""
    chunks = []
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks += json.loads(line.removeprefix("data: "))["choices"]
    return resp.headers, chunks


def _sources(server: RemoteServer) -> dict[str, float]:
    return {
        s: server.metric("prompt_tokens_by_source_total", source=s)
        for s in ("local_compute", "local_cache_hit", "external_kv_transfer")
    }


def _delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in before}


def _wait_pools_full(servers: dict[str, Any]) -> None:
    # Under the lease (30 s): a hand-off nobody reads would hold the prefill blocks past this.
    servers["prefill"].wait_pool_full(timeout=10)
    servers["decode"].wait_pool_full()


@pytest.mark.parametrize("stream", [False, True])
def test_n_seeded_sequences_share_one_transfer(servers: dict[str, Any], stream: bool) -> None:
    body = {
        "model": servers["model"],
        "prompt": _prompt(salt=1 + stream),
        "max_tokens": MAX_TOKENS,
        "n": N,
        "seed": 1234,
        "temperature": 1.0,
        "ignore_eos": True,
        "stream": stream,
    }
    want = [c["token_ids"] for c in _post(servers["plain"], body)[1]]
    assert len({tuple(t) for t in want}) > 1, "each sequence has its own seed"
    decode = servers["decode"]
    transfers, sources = decode.metric("kv_transfers_total"), _sources(decode)
    headers, choices = _post(servers["proxy"], body)
    assert headers["X-PD-Path"] == "remote"
    assert [c["token_ids"] for c in choices] == want
    assert decode.metric("kv_transfers_total") == transfers + 1
    # The first sequence loads the prompt (and continues from the shipped token); the others
    # hit its full blocks in the prefix cache and compute only the rest of the prompt.
    assert _delta(sources, _sources(decode)) == {
        "local_compute": (N - 1) * (PROMPT_LEN - 2 * BLOCK),
        "local_cache_hit": (N - 1) * 2 * BLOCK,
        "external_kv_transfer": PROMPT_LEN,
    }
    _wait_pools_full(servers)


def _logprobs(choice: dict, stream: bool) -> list[tuple[str, float, dict[str, float]]]:
    if stream:
        return choice["lp"]
    lp = choice["logprobs"]
    return list(zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]))


@pytest.mark.parametrize("stream", [False, True])
def test_first_token_logprobs_come_from_the_prefill_instance(
    servers: dict[str, Any], stream: bool
) -> None:
    body = {
        **greedy_body(servers["model"], _prompt(salt=3 + stream), MAX_TOKENS),
        "logprobs": 3,
        "stream": stream,
    }
    (want,) = _post(servers["plain"], body)[1]
    decode = servers["decode"]
    sources = _sources(decode)
    headers, (got,) = _post(servers["proxy"], body)
    assert headers["X-PD-Path"] == "remote"
    assert got["token_ids"] == want["token_ids"]
    got_lp, want_lp = _logprobs(got, stream), _logprobs(want, stream)
    assert len(got_lp) == len(want_lp) == MAX_TOKENS
    for (token, logprob, top), (want_token, want_logprob, want_top) in zip(got_lp, want_lp):
        assert token == want_token
        assert logprob == pytest.approx(want_logprob, abs=1e-4)
        assert top.keys() == want_top.keys()
        assert list(top.values()) == pytest.approx(list(want_top.values()), abs=1e-4)
    # Shipped: the decode instance loaded the whole prompt and did not recompute its last token.
    assert _delta(sources, _sources(decode))["local_compute"] == 0
    _wait_pools_full(servers)


@pytest.mark.parametrize("stream", [False, True])
def test_echo(servers: dict[str, Any], stream: bool) -> None:
    body = {**greedy_body(servers["model"], _prompt(salt=5 + stream), MAX_TOKENS), "stream": stream}
    ((_, (plain,)), (_, (echoed,))) = (
        _post(servers["plain"], body),
        _post(servers["plain"], {**body, "echo": True}),
    )
    assert echoed["text"] != plain["text"] and echoed["text"].endswith(plain["text"])
    headers, (got,) = _post(servers["proxy"], {**body, "echo": True})
    assert headers["X-PD-Path"] == "remote"
    assert (got["text"], got["token_ids"]) == (echoed["text"], echoed["token_ids"])
    _wait_pools_full(servers)


def _assert_logprobs_close(got: dict, want: dict) -> None:
    """Completion logprobs: tokens, offsets and top tokens exact, values within 1e-4."""
    assert (got["tokens"], got["text_offset"]) == (want["tokens"], want["text_offset"])
    assert [v is None for v in got["token_logprobs"]] == [v is None for v in want["token_logprobs"]]
    for value, want_value in zip(got["token_logprobs"], want["token_logprobs"]):
        assert value == pytest.approx(want_value, abs=1e-4)
    for top, want_top in zip(got["top_logprobs"], want["top_logprobs"]):
        assert (top is None) == (want_top is None)
        if top is not None:
            assert top.keys() == want_top.keys()
            assert list(top.values()) == pytest.approx(list(want_top.values()), abs=1e-4)


def _assert_prompt_logprobs_close(got: list, want: list) -> None:
    """vLLM's prompt_logprobs: token ids and ranks exact, values within 1e-4."""
    assert len(got) == len(want) and got[0] is None and want[0] is None
    for entries, want_entries in zip(got[1:], want[1:]):
        assert list(entries) == list(want_entries)
        for tid, entry in entries.items():
            assert entry["rank"] == want_entries[tid]["rank"]
            assert entry["decoded_token"] == want_entries[tid]["decoded_token"]
            assert entry["logprob"] == pytest.approx(want_entries[tid]["logprob"], abs=1e-4)


def test_prompt_logprobs_come_from_the_prefill_instance(servers: dict[str, Any]) -> None:
    """The prefill instance computes them with the prompt; the decode instance is not asked
    (it loads the prompt's KV and recomputes nothing)."""
    body = {**greedy_body(servers["model"], _prompt(salt=9), MAX_TOKENS), "prompt_logprobs": 2}
    (want,) = _post(servers["plain"], body)[1]
    decode = servers["decode"]
    sources = _sources(decode)
    headers, (got,) = _post(servers["proxy"], body)
    assert headers["X-PD-Path"] == "remote"
    assert got["token_ids"] == want["token_ids"]
    assert len(want["prompt_logprobs"]) == PROMPT_LEN
    _assert_prompt_logprobs_close(got["prompt_logprobs"], want["prompt_logprobs"])
    assert _delta(sources, _sources(decode))["local_compute"] == 0
    chat = {
        "model": servers["model"],
        "messages": [{"role": "user", "content": "the capital of France"}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "prompt_logprobs": 1,
    }
    answers = [
        httpx.post(f"{servers[s].url}/v1/chat/completions", json=chat, timeout=120)
        for s in ("plain", "proxy")
    ]
    assert [a.status_code for a in answers] == [200, 200], answers[1].text
    assert answers[1].headers["X-PD-Path"] == "remote"
    want_chat, got_chat = (a.json() for a in answers)
    _assert_prompt_logprobs_close(got_chat["prompt_logprobs"], want_chat["prompt_logprobs"])
    # vLLM's refusal, though the proxy's hop to the prefill instance is not streamed.
    resp = httpx.post(
        f"{servers['proxy'].url}/v1/completions", json={**body, "stream": True}, timeout=60
    )
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt_logprobs"
    _wait_pools_full(servers)


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_logprobs(servers: dict[str, Any], stream: bool) -> None:
    """The prompt's entries lead each choice's logprobs (a stream's first chunk per choice):
    the prefill instance's values in the decode instance's answer."""
    body = {
        "model": servers["model"],
        "prompt": _prompt(salt=11 + stream),
        "max_tokens": MAX_TOKENS,
        "n": 2,
        "seed": 99,
        "temperature": 1.0,
        "ignore_eos": True,
        "echo": True,
        "logprobs": 2,
        "stream": stream,
    }
    _, want = _post_logprobs(servers["plain"], body)
    assert len(want) == 2 and want[0]["text"] != want[1]["text"]
    headers, got = _post_logprobs(servers["proxy"], body)
    assert headers["X-PD-Path"] == "remote"
    for choice, want_choice in zip(got, want):
        assert (choice["text"], choice["token_ids"]) == (
            want_choice["text"],
            want_choice["token_ids"],
        )
        assert len(choice["logprobs"]["tokens"]) == PROMPT_LEN + MAX_TOKENS
        assert all(v is not None for v in choice["logprobs"]["token_logprobs"][1:])
        _assert_logprobs_close(choice["logprobs"], want_choice["logprobs"])
    _wait_pools_full(servers)


def _post_logprobs(server: RemoteServer, body: dict[str, Any]) -> tuple[httpx.Headers, list[dict]]:
    """Choices by index with their completion logprobs; a stream's chunks joined."""
    if not body.get("stream"):
        return _post(server, body)
    choices: dict[int, dict] = {}
    keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    headers, chunks = _stream_choices(server, body)
    for c in chunks:
        joined = choices.setdefault(
            c["index"], {"text": "", "token_ids": [], "logprobs": {k: [] for k in keys}}
        )
        joined["text"] += c["text"]
        joined["token_ids"] += c["token_ids"]
        for k in keys:
            joined["logprobs"][k] += c["logprobs"][k]
    return headers, [choices[i] for i in sorted(choices)]


def test_cache_salt_keeps_hits_within_a_salt_on_both_sides(servers: dict[str, Any]) -> None:
    """Both hops carry vLLM's cache_salt: the prefill instance's blocks and the decode
    instance's hits are the salt's, so a prompt hits through the split only under its own salt
    (a side that ignored it would report the other salts' two full blocks as cached)."""
    body = greedy_body(servers["model"], _prompt(salt=13), MAX_TOKENS)

    def cached(server: RemoteServer, salt: str | None) -> int:
        salted = body if salt is None else {**body, "cache_salt": salt}
        resp = httpx.post(f"{server.url}/v1/completions", json=salted, timeout=120)
        assert resp.status_code == 200, resp.text
        return resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    salts = ("tenant-a", "tenant-b", None, "tenant-a")
    assert [cached(servers["proxy"], s) for s in salts] == [0, 0, 0, 2 * BLOCK]
    # Each instance holds the prompt under the salts the split served, and under no other.
    for side in ("prefill", "decode"):
        assert cached(servers[side], "tenant-b") == 2 * BLOCK
        assert cached(servers[side], "tenant-c") == 0
    _wait_pools_full(servers)


def test_n_with_a_first_token_that_stops_is_served_locally_and_told(
    servers: dict[str, Any],
) -> None:
    body = {
        "model": servers["model"],
        "prompt": _prompt(salt=7),
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "n": 2,
    }
    first = _post(servers["plain"], {**body, "n": 1, "max_tokens": 1})[1][0]["token_ids"][0]
    body["stop_token_ids"] = [first]
    want = [(c["token_ids"], c["finish_reason"]) for c in _post(servers["plain"], body)[1]]
    assert [reason for _, reason in want] == ["stop", "stop"]
    headers, choices = _post(servers["proxy"], body)
    # The hop's sequence stopped, so no KV was kept for the other one: the decode instance
    # prefills, and says so.
    assert headers["X-PD-Path"] == "local; reason=first-token-stopped"
    assert [(c["token_ids"], c["finish_reason"]) for c in choices] == want
    _wait_pools_full(servers)
