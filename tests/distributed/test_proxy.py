"""Split deployments through the proxy, started by `pdserve launch` (tiny llama, 1P1D)."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.utils.pd import wait_all_pools_full
from tests.utils.procs import wait_until_gone
from tests.utils.server import RemoteServer, descendants
from tests.utils.tiny_models import hf_greedy

MAX_TOKENS = 10
PROMPTS = [f"prompt {i}: " + " ".join(["word"] * (i * 3)) for i in range(16)]


@pytest.fixture(scope="module")
def deployment(tiny_model: Callable[[str], str]) -> Iterator[RemoteServer]:
    with RemoteServer(["launch", "--model", tiny_model("llama"), "--dtype", "float32"]) as proxy:
        yield proxy
        assert proxy.stop() == [], "processes left behind"


def test_completions_through_proxy_match_reference(
    deployment: RemoteServer, tiny_model: Callable[[str], str]
) -> None:
    model = tiny_model("llama")
    client = deployment.client()
    tokenizer = AutoTokenizer.from_pretrained(model)
    reference = hf_greedy(Path(model), [tokenizer.encode(p) for p in PROMPTS], MAX_TOKENS)

    async def run() -> list[openai.types.Completion]:
        aclient = deployment.async_client()
        return await asyncio.gather(
            *[
                aclient.completions.create(
                    model=model,
                    prompt=p,
                    max_tokens=MAX_TOKENS,
                    temperature=0,
                    extra_body={"ignore_eos": True},
                )
                for p in PROMPTS
            ]
        )

    results = asyncio.run(run())
    assert [r.choices[0].model_extra["token_ids"] for r in results] == reference
    for prompt, full in zip(PROMPTS, results):
        chunks = client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    wait_all_pools_full(deployment)


def test_chat_through_proxy_matches_reference(
    deployment: RemoteServer, tiny_model: Callable[[str], str]
) -> None:
    model = tiny_model("llama")
    client = deployment.client()
    tokenizer = AutoTokenizer.from_pretrained(model)
    for prompt in PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        expected = hf_greedy(Path(model), [ids], MAX_TOKENS)[0]
        full = client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert full.choices[0].model_extra["token_ids"] == expected
        chunks = client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        assert (
            "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            == full.choices[0].message.content
        )
    wait_all_pools_full(deployment)


def test_proxy_health_models_and_request_id(deployment: RemoteServer) -> None:
    health = httpx.get(f"{deployment.url}/health").json()
    assert health["status"] == "ok" and len(health["prefill"]) == 1 and len(health["decode"]) == 1
    model = deployment.client().models.list().data[0].id
    resp = httpx.post(
        f"{deployment.url}/v1/completions",
        headers={"X-Request-Id": "my-id-1"},
        json={"model": model, "prompt": "hi", "max_tokens": 2},
        timeout=60,
    )
    assert resp.status_code == 200 and resp.json()["id"] == "cmpl-my-id-1"
    assert resp.headers["x-request-id"] == "my-id-1" and int(resp.headers["x-pd-kv-blocks"]) == 1
    # Bad input is the client's error, through the proxy as well.
    bad = httpx.post(
        f"{deployment.url}/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 0}
    )
    assert bad.status_code == 400 and "max_tokens" in bad.json()["error"]["message"]
    garbage = httpx.post(f"{deployment.url}/v1/completions", content=b"{nope")
    assert garbage.status_code == 400


def test_client_disconnect_through_proxy_frees_both_sides(deployment: RemoteServer) -> None:
    model = deployment.client().models.list().data[0].id
    body = {
        "model": model,
        "prompt": "a long answer",
        "max_tokens": 900,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{deployment.url}/v1/completions", json=body, timeout=60) as resp:
        lines = resp.iter_lines()
        assert any(line.startswith("data:") for line, _ in zip(lines, range(4)))
    wait_all_pools_full(deployment, timeout=30)


def _launch_pids(server: RemoteServer) -> list[int]:
    return [server.proc.pid, *descendants(server.proc.pid)]


def test_launch_stops_everything_on_sigterm(tiny_model: Callable[[str], str]) -> None:
    server = RemoteServer(["launch", "--model", tiny_model("llama"), "--dtype", "float32"])
    pids = _launch_pids(server)
    assert len(pids) >= 7, "launcher, 2 instances with their engines, the proxy"
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(60) == 0
    assert wait_until_gone(pids, 30) == []
    server.stop()


def test_launch_stops_everything_when_a_child_dies(tiny_model: Callable[[str], str]) -> None:
    server = RemoteServer(["launch", "--model", tiny_model("llama"), "--dtype", "float32"])
    pids = _launch_pids(server)
    decode_url = httpx.get(f"{server.url}/health").json()["decode"][0]["url"]
    port = decode_url.rsplit(":", 1)[1]
    victim = next(
        p
        for p in descendants(server.proc.pid)
        if f"--port {port}" in open(f"/proc/{p}/cmdline").read().replace("\0", " ")
    )
    os.kill(victim, signal.SIGKILL)
    assert server.proc.wait(60) == 1
    assert wait_until_gone(pids, 30) == []
    assert "exited" in server.read_log()
    server.stop()
