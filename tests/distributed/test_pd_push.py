"""Push mode through the proxy (`--kv-mode push`, NixlPushConnector instances): both hops leave at
once, the prefill instance writes the KV into the decode instance's blocks, and the answers are
HF transformers' greedy tokens, for each transport, instance count and TP layout; every pool is
full afterwards and no lease expired (docs/push.md)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest

from tests.utils.pd import greedy_body, split_proxy, start_instance
from tests.utils.server import start_together
from tests.utils.tiny_models import hf_greedy

MAX_TOKENS = 10
# Under one block, exactly two blocks, several blocks plus a partial one.
PROMPTS = [[7, 8, 9], list(range(10, 42)), [(i * 37) % 400 + 5 for i in range(75)]]
PUSH = "NixlPushConnector"

CASES = [
    # (model, transport, prefill instances, decode instances, prefill TP, decode TP). Slow as the
    # rest (30 s and more each): the default stage runs push mode on the connector's real halves
    # over both transports (tests/unit/kv_connector/test_push_lifecycle.py). Each layout once,
    # the transports alternating (test_pd_push_faults.py pushes 1 -> 1 over NIXL too).
    pytest.param("llama", "ucx", 1, 1, 1, 1, id="ucx-1to1", marks=pytest.mark.slow),
    pytest.param("llama", "nixl", 1, 2, 1, 1, id="nixl-1to2", marks=pytest.mark.slow),
    pytest.param("llama", "ucx", 2, 1, 1, 1, id="ucx-2to1", marks=pytest.mark.slow),
    pytest.param("llama", "ucx", 1, 1, 1, 2, id="ucx-tp1-tp2", marks=pytest.mark.slow),
    pytest.param("llama", "nixl", 1, 1, 2, 1, id="nixl-tp2-tp1", marks=pytest.mark.slow),
    # MLA's latent from one of two prefill ranks: the other registration is empty.
    pytest.param("deepseek_v2", "ucx", 1, 1, 2, 1, id="mla-ucx-tp2-tp1", marks=pytest.mark.slow),
]


@pytest.fixture(scope="module")
def reference(tiny_model: Callable[[str], str]) -> Callable[[str], list[list[int]]]:
    return functools.cache(lambda arch: hf_greedy(Path(tiny_model(arch)), PROMPTS, MAX_TOKENS))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("arch,transport,num_prefill,num_decode,prefill_tp,decode_tp", CASES)
def test_push_through_proxy_matches_hf(
    tiny_model: Callable[[str], str],
    reference: Callable[[str], list[list[int]]],
    arch: str,
    transport: str,
    num_prefill: int,
    num_decode: int,
    prefill_tp: int,
    decode_tp: int,
) -> None:
    model = tiny_model(arch)
    servers = start_together(
        *[
            lambda: start_instance(model, "kv_producer", transport, prefill_tp, connector=PUSH)
            for _ in range(num_prefill)
        ],
        *[
            lambda: start_instance(model, "kv_consumer", transport, decode_tp, connector=PUSH)
            for _ in range(num_decode)
        ],
    )
    prefills, decodes = servers[:num_prefill], servers[num_prefill:]
    try:
        proxy = split_proxy(prefills, decodes, "--kv-mode", "push")
        servers.append(proxy)
        client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="x")
        for _ in range(2):  # enough to reach every instance
            for prompt, expected in zip(PROMPTS, reference(arch)):
                resp = httpx.post(
                    f"{proxy.url}/v1/completions",
                    json=greedy_body(model, prompt, MAX_TOKENS),
                    timeout=120,
                )
                assert resp.status_code == 200, resp.text
                assert resp.headers["X-PD-Path"] == "remote"
                assert resp.headers["X-PD-KV-Mode"] == "push"
                assert resp.json()["choices"][0]["token_ids"] == expected
        # Streamed, with the official client: the same tokens.
        stream = client.completions.create(
            model=model,
            prompt=PROMPTS[2],
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        streamed = [t for chunk in stream for t in (chunk.choices[0].token_ids or [])]
        assert streamed == reference(arch)[2]
        # Counted by each decode worker rank.
        pushed = sum(d.metric("kv_transfers_total") for d in decodes) / decode_tp
        # The first round pushed every prompt. A decode instance that holds all but the last
        # block of a prompt computes that block itself (the longer prompts, a second time on
        # the same instance); one under a block has no hit and is pushed again.
        if num_decode == 1:
            assert pushed == len(PROMPTS) + 1
        else:  # a prompt's second time may land on the other decode instance
            assert len(PROMPTS) + 1 <= pushed <= 2 * len(PROMPTS)
        for server in prefills + decodes:
            server.wait_pool_full(timeout=60)
        assert sum(p.metric("kv_expired_leases_total") for p in prefills) == 0
        assert sum(d.metric("kv_failed_transfers_total") for d in decodes) == 0
    finally:
        for server in reversed(servers):
            assert server.stop() == [], "processes left behind"
