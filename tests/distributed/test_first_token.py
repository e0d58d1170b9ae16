"""First-token shipping through a real prefill/decode pair (kv_connector/first_token.py): the
decode instance streams the token the prefill instance sampled before its KV has arrived, then
continues from it, token-exact against HF under both runners, also where the prompt fills its
last block exactly (pd_lessons 18); a first token that ends the request hands nothing over."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.utils.faults import FaultPlan, rule
from tests.utils.pd import greedy_body, prefill, start_instance
from tests.utils.server import start_together
from tests.utils.tiny_models import hf_greedy

BLOCK = 16
MAX_TOKENS = 8


def _prompt(n: int, salt: int = 0) -> list[int]:
    """Prompts with different salts share no block: no test finds another's prefix cached."""
    return [salt + 5] + [(i * 11 + salt * 37) % 300 + 3 for i in range(n - 1)]


class Trio:
    """A prefill instance, a decode instance under each runner, a fault plan for decode V2."""

    def __init__(self, model: str, folder: Path) -> None:
        self.model = model
        self.plan = FaultPlan(folder)
        self.servers = start_together(
            lambda: start_instance(model, "kv_producer"),
            lambda: start_instance(model, "kv_consumer", env=self.plan.env),
            lambda: start_instance(model, "kv_consumer", runner="0"),
        )
        self.p, self.d, self.d_v1 = self.servers

    def stop(self) -> list[int]:
        return [pid for s in self.servers for pid in s.stop()]


@pytest.fixture(scope="module")
def trio(
    tiny_model: Callable[[str], str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Trio]:
    trio = Trio(tiny_model("llama"), tmp_path_factory.mktemp("first_token"))
    try:
        yield trio
    finally:
        assert trio.stop() == []


def _reference(trio: Trio, prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    return hf_greedy(Path(trio.model), [prompt], max_tokens)[0]


def _stream_chunks(resp: httpx.Response) -> Iterator[dict]:
    for line in resp.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line.removeprefix("data: "))


def test_decode_streams_the_shipped_token_before_its_kv_arrives(trio: Trio) -> None:
    prompt = _prompt(70)
    reference = _reference(trio, prompt)
    body = greedy_body(trio.model, prompt, MAX_TOKENS)
    params = prefill(trio.p, body)
    assert params["first_token_id"] == reference[0]
    trio.plan.set(rule("hold", "read", "delay", contains=params["remote_request_id"]))
    try:
        with httpx.stream(
            "POST",
            f"{trio.d.url}/v1/completions",
            json={**body, "stream": True, "kv_transfer_params": params},
            timeout=120,
        ) as resp:
            assert resp.status_code == 200
            chunks = _stream_chunks(resp)
            first = next(chunks)
            # The READ cannot end before the hold is released: this token came without the KV.
            trio.plan.wait_fired("hold")
            assert trio.d.metric("num_requests_waiting") == 1
            assert first["choices"][0]["token_ids"] == reference[:1]
            trio.plan.release("hold")
            rest = [t for c in chunks if c["choices"] for t in c["choices"][0]["token_ids"]]
    finally:
        trio.plan.set()
    assert reference[:1] + rest == reference
    trio.d.wait_pool_full()
    trio.p.wait_pool_full()


@pytest.mark.parametrize("prompt_len", [2 * BLOCK - 1, 2 * BLOCK, 3 * BLOCK + 1])
@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_continues_from_the_shipped_token_token_exact(
    trio: Trio, runner: str, prompt_len: int
) -> None:
    decode = trio.d_v1 if runner == "v1" else trio.d
    prompt = _prompt(prompt_len, salt=prompt_len * 2 + (runner == "v1"))
    body = greedy_body(trio.model, prompt, MAX_TOKENS)
    params = prefill(trio.p, body)
    transfers = decode.metric("kv_transfers_total")
    resp = httpx.post(
        f"{decode.url}/v1/completions", json={**body, "kv_transfer_params": params}, timeout=120
    )
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert choice["token_ids"] == _reference(trio, prompt)
    assert resp.json()["usage"]["completion_tokens"] == MAX_TOKENS
    assert decode.metric("kv_transfers_total") == transfers + 1
    decode.wait_pool_full()
    trio.p.wait_pool_full()


def test_a_first_token_that_stops_hands_nothing_over(trio: Trio) -> None:
    prompt = _prompt(40, salt=1)
    first = _reference(trio, prompt, 1)[0]
    body = {**greedy_body(trio.model, prompt, MAX_TOKENS), "stop_token_ids": [first]}
    hop = {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    resp = httpx.post(f"{trio.p.url}/v1/completions", json=hop, timeout=120)
    assert resp.status_code == 200, resp.text
    answer = resp.json()
    assert answer["choices"][0]["finish_reason"] == "stop"
    assert answer.get("kv_transfer_params") is None
    expired = trio.p.metric("kv_expired_leases_total")
    trio.p.wait_pool_full(timeout=10)
    assert trio.p.metric("kv_expired_leases_total") == expired, "freed at once, not by its lease"
