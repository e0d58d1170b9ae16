"""Models with state through the split (Mamba, and Qwen3.5's hybrid of DeltaNet and attention):
the prefill instance hands over a request's recurrent state (every layer's, in the rows of its
one block after the attention layers' KV: models/state_cache.py) and the decode instance
continues from it, token-exact against HF transformers, pulled over both transports and pushed;
what moves per request does not grow with the prompt; a prefill killed before the read fails the
request and leaves the decode side's pool full."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch

from pdserve.config import ModelConfig
from pdserve.models.state_cache import slot_bytes
from tests.utils.pd import greedy_body, prefill, split_proxy, split_request, start_instance
from tests.utils.server import sigkill, start_together
from tests.utils.tiny_models import hf_greedy

MAX_TOKENS = 10
MAX_MODEL_LEN = 128
PROMPTS = [[7, 8, 9], list(range(10, 42)), [(i * 37) % 400 + 5 for i in range(75)]]
ARGS = ["--max-model-len", str(MAX_MODEL_LEN)]
PUSH = "NixlPushConnector"


def block_bytes_bounds(model: str, tp: int) -> tuple[int, int]:
    """What the decode ranks read for a request's one block: on each, MAX_MODEL_LEN tokens of
    its attention layers' KV (its share of the KV heads), then its share of the state in rows
    of one layer's share (state_cache.py), the last row partly padding."""
    config = ModelConfig(model=model)
    geometry = config.kv_cache_geometry
    heads = max(1, geometry.num_kv_heads // tp)
    row = MAX_MODEL_LEN * geometry.kv_parts * heads * geometry.head_dim * 4
    low = geometry.num_layers * row + slot_bytes(config.state_shapes, torch.float32) // tp
    return tp * low, tp * (low + row)


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "transport", "tp"), [("mamba", "nixl", 1), ("qwen3_5", "ucx", 2)])
def test_state_pulled_through_split(tiny_model, arch: str, transport: str, tp: int) -> None:
    """With TP 2 each decode rank reads its prefill rank's share of the state."""
    model = tiny_model(arch)
    expected = hf_greedy(Path(model), PROMPTS, MAX_TOKENS)
    servers = start_together(
        lambda: start_instance(model, "kv_producer", transport, tp, runner="0", extra_args=ARGS),
        lambda: start_instance(model, "kv_consumer", transport, tp, runner="0", extra_args=ARGS),
    )
    p, d = servers
    try:
        moved = []
        for prompt, tokens in zip(PROMPTS, expected):
            before = d.metric("kv_transfer_bytes_total")
            resp = split_request(p, d, greedy_body(model, prompt, MAX_TOKENS))
            assert resp.status_code == 200, resp.text
            assert resp.json()["choices"][0]["token_ids"] == tokens
            moved.append(d.metric("kv_transfer_bytes_total") - before)
        # One block a request, whatever its prompt: the state and its rows' padding.
        low, high = block_bytes_bounds(model, tp)
        assert len(set(moved)) == 1 and low <= moved[0] < high, moved
        # No shipped token to continue from (one token asked): the decode side computes the
        # prompt again rather than apply its last token twice to the state.
        resp = split_request(p, d, greedy_body(model, PROMPTS[2], 1))
        assert resp.json()["choices"][0]["token_ids"] == expected[2][:1]
        # The prefill hop must stop at its prompt: the state it hands over is the prompt's.
        hop = {
            **greedy_body(model, PROMPTS[0], 2),
            "kv_transfer_params": {"do_remote_decode": True},
        }
        resp = httpx.post(f"{p.url}/v1/completions", json=hop, timeout=60)
        assert resp.status_code == 400
        assert "do_remote_decode needs max_tokens=1 for " in resp.text
        for server in servers:
            server.wait_pool_full(timeout=30)
        if transport == "nixl":
            # A prefill instance killed before the read: the request fails, the pool is full.
            params = prefill(p, greedy_body(model, PROMPTS[1], MAX_TOKENS))
            sigkill(p)
            body = {**greedy_body(model, PROMPTS[1], MAX_TOKENS), "kv_transfer_params": params}
            resp = httpx.post(f"{d.url}/v1/completions", json=body, timeout=120)
            assert resp.status_code == 500, resp.text
            d.wait_pool_full(timeout=30)
    finally:
        for server in servers:
            assert server.stop() == [], "processes left behind"


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "transport"), [("mamba", "ucx"), ("qwen3_5", "nixl")])
def test_state_pushed_through_proxy(tiny_model, arch: str, transport: str) -> None:
    model = tiny_model(arch)
    expected = hf_greedy(Path(model), PROMPTS, MAX_TOKENS)
    servers = start_together(
        lambda: start_instance(
            model, "kv_producer", transport, runner="0", extra_args=ARGS, connector=PUSH
        ),
        lambda: start_instance(
            model, "kv_consumer", transport, runner="0", extra_args=ARGS, connector=PUSH
        ),
    )
    p, d = servers
    try:
        proxy = split_proxy(p, d, "--kv-mode", "push")
        servers.append(proxy)
        for prompt, tokens in zip(PROMPTS, expected):
            resp = httpx.post(
                f"{proxy.url}/v1/completions",
                json=greedy_body(model, prompt, MAX_TOKENS),
                timeout=120,
            )
            assert resp.status_code == 200, resp.text
            assert resp.json()["choices"][0]["token_ids"] == tokens
        assert d.metric("kv_transfers_total") >= len(PROMPTS)
        for server in (p, d):
            server.wait_pool_full(timeout=30)
    finally:
        for server in servers:
            assert server.stop() == [], "processes left behind"
