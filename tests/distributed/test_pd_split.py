"""A prefill instance and a decode instance in separate processes give a single instance's
tokens, for each transport, runner, and TP layout (tiny llama: 4 heads, 2 KV heads; tiny
DeepSeek-V2: its latent)."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from pdserve.config import ModelConfig
from tests.utils.pd import greedy_body, prefill, split_request, start_instance
from tests.utils.server import RemoteServer, start_together
from tests.utils.tiny_models import hf_greedy

MAX_TOKENS = 12
# Token prompts: under one block, exactly two blocks, several blocks plus a partial one.
PROMPTS = [
    [7, 8, 9],
    list(range(10, 42)),
    [(i * 37) % 400 + 5 for i in range(75)],
    list(range(3, 20)),
]

CASES = [
    # Slow as the rest: a split is token-exact against HF in the default suite through
    # test_first_token.py (both runners), test_proxy.py (pdserve launch), test_proxy_paths.py.
    # Every pair of transport, TP layout and runner once (all-pairs), for llama (a key and a
    # value per KV head) and DeepSeek-V2 (MLA: one latent per token, the same on every rank;
    # its layouts that split or gather ranks, with each transport and runner).
    pytest.param("llama", "nixl", 1, 1, "1", id="llama-nixl-tp1-tp1-v2", marks=pytest.mark.slow),
    pytest.param("llama", "ucx", 1, 1, "0", id="llama-ucx-tp1-tp1-v1", marks=pytest.mark.slow),
    pytest.param("llama", "nixl", 1, 2, "1", id="llama-nixl-tp1-tp2-v2", marks=pytest.mark.slow),
    pytest.param("llama", "nixl", 2, 1, "0", id="llama-nixl-tp2-tp1-v1", marks=pytest.mark.slow),
    pytest.param("llama", "ucx", 1, 2, "0", id="llama-ucx-tp1-tp2-v1", marks=pytest.mark.slow),
    pytest.param("llama", "ucx", 2, 1, "1", id="llama-ucx-tp2-tp1-v2", marks=pytest.mark.slow),
    # The other families once each: Gemma2's windowed and soft-capped layers, GraniteMoE's.
    pytest.param("gemma2", "nixl", 1, 1, "1", id="gemma2-nixl-tp1-tp1-v2", marks=pytest.mark.slow),
    pytest.param(
        "granitemoe", "ucx", 1, 1, "0", id="granite-ucx-tp1-tp1-v1", marks=pytest.mark.slow
    ),
    pytest.param(
        "deepseek_v2", "nixl", 1, 2, "0", id="mla-nixl-tp1-tp2-v1", marks=pytest.mark.slow
    ),
    pytest.param("deepseek_v2", "ucx", 2, 1, "1", id="mla-ucx-tp2-tp1-v2", marks=pytest.mark.slow),
]


def read_bytes(model: str, num_blocks: int, prefill_tp: int, decode_tp: int) -> int:
    """What the decode instance reads for `num_blocks` blocks of 16 tokens (float32): a latent
    whole by every decode rank from one prefill rank; heads split over ranks whole blocks by each
    decode rank of a prefill rank, once in all when prefill TP >= decode TP."""
    geometry = ModelConfig(model=model).kv_cache_geometry
    block = 16 * geometry.bytes_per_token(4)
    readers = decode_tp if geometry.latent else max(1, decode_tp // prefill_tp)
    return num_blocks * block * readers


@pytest.fixture(scope="module")
def reference(tiny_model: Callable[[str], str]) -> Callable[[str], list[list[int]]]:
    return functools.cache(lambda arch: hf_greedy(Path(tiny_model(arch)), PROMPTS, MAX_TOKENS))


@pytest.mark.parametrize("arch,transport,prefill_tp,decode_tp,runner", CASES)
def test_split_matches_reference(
    tiny_model: Callable[[str], str],
    reference: Callable[[str], list[list[int]]],
    arch: str,
    transport: str,
    prefill_tp: int,
    decode_tp: int,
    runner: str,
) -> None:
    model = tiny_model(arch)
    servers = start_together(
        lambda: start_instance(model, "kv_producer", transport, prefill_tp, runner),
        lambda: start_instance(model, "kv_consumer", transport, decode_tp, runner),
    )
    p, d = servers
    try:
        bytes_read = []
        for prompt, expected in zip(PROMPTS, reference(arch)):
            before = d.metric("kv_transfer_bytes_total")
            body = {
                "model": model,
                "prompt": prompt,
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
            }
            resp = split_request(p, d, body)
            assert resp.status_code == 200, resp.text
            assert resp.json()["choices"][0]["token_ids"] == expected
            bytes_read.append(d.metric("kv_transfer_bytes_total") - before)
        # Exactly the cache the model keeps: PROMPTS[2] (75 tokens) fills 5 blocks.
        assert bytes_read[2] == read_bytes(model, 5, prefill_tp, decode_tp)
        assert all(b > 0 for b in bytes_read) and d.metric("kv_transfers_total") >= len(PROMPTS)
        # A prefix hit on the decode side: it reads only the block it does not hold (1 of 5).
        before = d.metric("kv_transfer_bytes_total")
        body = {
            "model": model,
            "prompt": PROMPTS[2],
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
        }
        resp = split_request(p, d, body)
        assert resp.json()["choices"][0]["token_ids"] == reference(arch)[2]
        assert d.metric("kv_transfer_bytes_total") - before == bytes_read[2] / 5
        for server in servers:
            server.wait_pool_full(timeout=30)
        assert p.metric("kv_expired_leases_total") == 0
    finally:
        for server in servers:
            assert server.stop() == [], "processes left behind"


# On the instances the default suite shares (tests/distributed/conftest.py): no start of its own.
@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_chat_and_streaming_through_split(
    tiny_model: Callable[[str], str], pd_instances: dict[str, RemoteServer], endpoint: str
) -> None:
    model = tiny_model("llama")
    p, d = pd_instances["prefill"], pd_instances["decode"]
    if endpoint == "completions":
        body = {
            "model": model,
            "prompt": "the quick brown fox",
            "max_tokens": 10,
            "temperature": 0,
        }
    else:
        body = {
            "model": model,
            "messages": [{"role": "user", "content": "hi there"}],
            "max_tokens": 10,
            "temperature": 0,
        }
    single = d.client()
    direct = (
        single.completions.create(**body)
        if endpoint == "completions"
        else single.chat.completions.create(**body)
    )
    expected = (
        direct.choices[0].text if endpoint == "completions" else direct.choices[0].message.content
    )
    resp = split_request(p, d, body, endpoint)
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert (
        choice["text"] if endpoint == "completions" else choice["message"]["content"]
    ) == expected
    streamed = split_request(p, d, {**body, "stream": True}, endpoint)
    chunks = [
        json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")
    ]
    key = "text" if endpoint == "completions" else "delta"
    parts = [c["choices"][0][key] for c in chunks if c["choices"]]
    joined = "".join(x if isinstance(x, str) else x.get("content", "") for x in parts)
    assert joined == expected
    for server in (p, d):
        server.wait_pool_full(timeout=30)


SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


def test_cached_tokens_through_split(
    tiny_model: Callable[[str], str], pd_instances: dict[str, RemoteServer]
) -> None:
    """pd_lessons 17: the client of a split sees the prefill instance's prefix-cache hits and
    the decode instance's local ones, a token hit on both counted once; each instance's
    prompt_tokens_by_source add up to its prompts (40-token prompts: two full blocks)."""
    model = tiny_model("llama")
    p, d = pd_instances["prefill"], pd_instances["decode"]
    before = {
        server: {s: server.metric("prompt_tokens_by_source_total", source=s) for s in SOURCES}
        for server in (p, d)
    }
    prompts = {n: [(i * 11 + k) % 300 + 10 for i in range(40)] for k, n in enumerate("abce")}
    num_prompt_tokens = {p: 0, d: 0}

    def hop(name: str) -> dict:
        body = greedy_body(model, prompts[name], 4)
        num_prompt_tokens[p] += 40
        num_prompt_tokens[d] += 40
        return {**body, "kv_transfer_params": prefill(p, body)}

    def split(name: str) -> int:
        resp = httpx.post(f"{d.url}/v1/completions", json=hop(name), timeout=120)
        assert resp.status_code == 200, resp.text
        return resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    def direct(server: RemoteServer, name: str) -> None:
        body = greedy_body(model, prompts[name], 2)
        resp = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        num_prompt_tokens[server] += 40

    assert split("a") == 0  # nothing cached anywhere
    assert split("a") == 32  # both instances hit the same two blocks: 32, not 64
    direct(p, "b")
    assert split("b") == 32  # only the prefill instance holds b: its hits reach the client
    direct(d, "c")
    assert split("c") == 32  # only the decode instance holds c
    # Streamed, the usage chunk says the same (only the prefill instance holds e).
    direct(p, "e")
    body = hop("e")
    params, ignore_eos = body.pop("kv_transfer_params"), body.pop("ignore_eos")
    assert params["remote_cached_tokens"] == 32
    chunks = list(
        d.client().completions.create(
            **body,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"kv_transfer_params": params, "ignore_eos": ignore_eos},
        )
    )
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 32

    # The prefill instance's own hits: a, b and e again; the decode instance's: a, then c.
    for server, local_hits in ((p, 3 * 32), (d, 2 * 32)):
        server.wait_pool_full(timeout=30)
        delta = {
            s: server.metric("prompt_tokens_by_source_total", source=s) - before[server][s]
            for s in SOURCES
        }
        assert sum(delta.values()) == num_prompt_tokens[server]
        assert delta["local_cache_hit"] == local_hits
    assert delta["external_kv_transfer"] > 0
