"""Speculation on the decode instance of a split: the proxy's answers are HF's greedy tokens, as
a single instance speculating alike gives them, and the mean acceptance length through the
proxy is within 5% of the single instance's (vLLM's P/D check); pools full after.

- n-gram, pull: nothing crosses the wire for it; the prefill instance has no speculative config.
- draft model, push: the draft's KV of the prompt crosses in the target's blocks (the prefill
  instance runs the same draft). The draft is the target itself, so on both sides every draft
  is accepted only if the draft KV that arrived is right.
- EAGLE on runner V2, pull: the head's KV of the prompt crosses in the target's blocks; the
  decode side computes the shipped token's hidden state itself."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.unit.engine.test_eagle import eagle
from tests.unit.engine.test_spec_decode import NGRAM, copy_heavy_prompts, draft_model
from tests.utils.pd import greedy_body, split_proxy, start_instance
from tests.utils.server import RemoteServer, start_together
from tests.utils.tiny_models import VOCAB_SIZE, hf_greedy, make_tiny_eagle_head

MAX_TOKENS = 24


def acceptance_length(server: RemoteServer) -> float:
    drafts = server.metric("spec_decode_num_drafts_total")
    return 1 + server.metric("spec_decode_num_accepted_tokens_total") / drafts


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle"])
def test_speculation_on_the_decode_instance_matches_a_single_instance(
    tiny_model, tmp_path, method
) -> None:
    model = tiny_model("llama")
    prompts = copy_heavy_prompts(VOCAB_SIZE)
    expected = hf_greedy(Path(model), prompts, MAX_TOKENS)
    config = {
        "ngram": NGRAM,
        "draft_model": draft_model(model),
        "eagle": eagle(make_tiny_eagle_head(tmp_path / "eagle")),
    }[method]
    spec = ["--speculative-config", json.dumps(config)]
    # The n-gram and EAGLE splits pull, the draft model's pushes; EAGLE runs on runner V2.
    connector = "NixlPushConnector" if method == "draft_model" else "NixlConnector"
    prefill_args = [] if method == "ngram" else spec
    runner = "1" if method == "eagle" else "0"
    servers = start_together(
        lambda: RemoteServer(
            ["serve", "--model", model, "--dtype", "float32", *spec],
            env={"PDSERVE_USE_V2_MODEL_RUNNER": runner},
        ),
        lambda: start_instance(
            model, "kv_producer", runner=runner, extra_args=prefill_args, connector=connector
        ),
        lambda: start_instance(
            model, "kv_consumer", runner=runner, extra_args=spec, connector=connector
        ),
    )
    single, p, d = servers
    try:
        proxy = split_proxy(p, d, *(["--kv-mode", "push"] if method == "draft_model" else []))
        servers.append(proxy)
        for server in (single, proxy):
            for prompt, tokens in zip(prompts, expected):
                resp = httpx.post(
                    f"{server.url}/v1/completions",
                    json=greedy_body(model, prompt, MAX_TOKENS),
                    timeout=120,
                )
                assert resp.status_code == 200, resp.text
                assert resp.json()["choices"][0]["token_ids"] == tokens
        assert d.metric("spec_decode_num_drafts_total") > 0
        assert acceptance_length(d) == pytest.approx(acceptance_length(single), rel=0.05)
        if method == "draft_model":
            for server in (single, d):
                accepted = server.metric("spec_decode_num_accepted_tokens_total")
                assert accepted == server.metric("spec_decode_num_draft_tokens_total")
        for server in (single, p, d):
            server.wait_pool_full(timeout=30)
    finally:
        for server in servers:
            assert server.stop() == [], "processes left behind"
