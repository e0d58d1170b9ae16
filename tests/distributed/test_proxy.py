"""Split deployments through the proxy, started by `pdserve launch` (tiny llama, 1P1D)."""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from tests.utils.headers import check_hostile_headers
from tests.utils.pd import complete_all, hf_reference, instances, prefill, wait_all_pools_full
from tests.utils.procs import wait_until_gone
from tests.utils.server import RemoteServer, descendants
from tests.utils.tiny_models import hf_greedy

MAX_TOKENS = 10
PROMPTS = [f"prompt {i}: " + " ".join(["word"] * (i * 3)) for i in range(16)]


@pytest.fixture(scope="module")
def deployment(tiny_model: Callable[[str], str]) -> Iterator[RemoteServer]:
    launch = ["launch", "--model", tiny_model("llama"), "--pd-min-uncached-tokens", "0"]
    with RemoteServer([*launch, "--dtype", "float32"]) as proxy:
        yield proxy
        # Ctrl-C, which reaches the launcher alone (each child has its own session): an orderly
        # stop, logged at INFO (issue 27).
        start = proxy.log_size()
        proxy.proc.send_signal(signal.SIGINT)
        assert proxy.proc.wait(60) == 0
        assert proxy.stop() == [], "processes left behind"
        assert proxy.complaints_since(start) == []


def test_completions_through_proxy_match_reference(
    deployment: RemoteServer, tiny_model: Callable[[str], str]
) -> None:
    model = tiny_model("llama")
    client = deployment.client()
    reference = hf_reference(model, PROMPTS, MAX_TOKENS)
    results = asyncio.run(complete_all(deployment, model, PROMPTS, MAX_TOKENS))
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


def test_cached_tokens_through_proxy(deployment: RemoteServer) -> None:
    """pd_lessons 17 through `pdserve launch`: the client sees the prefix-cache hits of the
    split (40-token prompts: two full blocks), streamed or not."""
    model = deployment.client().models.list().data[0].id
    client = deployment.client()
    args = {"model": model, "max_tokens": 3, "temperature": 0}
    first, again = ([(i * 13 + k) % 300 + 10 for i in range(40)] for k in (0, 1))
    cached = [
        client.completions.create(prompt=first, **args).usage.prompt_tokens_details.cached_tokens
        for _ in range(2)
    ]
    assert cached == [0, 32]
    # Only the prefill instance holds `again`: what the decode instance reports includes its hits.
    prefill_url = instances(deployment)["prefill"][0].url
    resp = httpx.post(f"{prefill_url}/v1/completions", json={**args, "prompt": again}, timeout=60)
    assert resp.status_code == 200, resp.text
    chunks = list(
        client.completions.create(
            prompt=again, stream=True, stream_options={"include_usage": True}, **args
        )
    )
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 32
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


def test_hostile_headers_never_take_an_instance_down(
    deployment: RemoteServer, tiny_model: Callable[[str], str]
) -> None:
    """Issue 27: an empty bearer, whitespace around a value, control characters, over-long and
    repeated values, non-ASCII. Each is normalized or the client's 400 naming the header; a
    plain request right after is served, and every instance stays healthy."""
    body = {"model": tiny_model("llama"), "prompt": "hello there my friend", "max_tokens": 4}
    check_hostile_headers(deployment.url, body)
    wait_all_pools_full(deployment)


def test_client_disconnect_through_proxy_frees_both_sides(deployment: RemoteServer) -> None:
    """The client reads a few chunks of a stream it asked nearly a whole context of, then goes
    away: the decode instance aborts the request (its abort counter moves), long before the
    tokens asked for are out, and both sides free every block."""
    model = deployment.client().models.list().data[0].id
    decode = instances(deployment)["decode"][0]
    wait_all_pools_full(deployment)
    before = {
        reason: decode.metric("request_success_total", finished_reason=reason)
        for reason in ("abort", "length")
    }
    generated = decode.metric("generation_tokens_total")
    max_tokens = 1000
    body = {
        "model": model,
        "prompt": "a long answer",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{deployment.url}/v1/completions", json=body, timeout=60) as resp:
        lines = resp.iter_lines()
        assert any(line.startswith("data:") for line, _ in zip(lines, range(4)))
    wait_all_pools_full(deployment, timeout=30)
    assert decode.metric("request_success_total", finished_reason="abort") == before["abort"] + 1
    assert decode.metric("request_success_total", finished_reason="length") == before["length"]
    assert decode.metric("generation_tokens_total") - generated < max_tokens


# Long enough that the first request is still generating when its duplicate comes.
DUP_TOKENS = 300


def _stream_tokens(lines: Iterator[str]) -> list[int]:
    """The token ids of a completion's SSE lines, to [DONE]."""
    tokens = []
    for line in lines:
        if line == "data: [DONE]":
            break
        if line.startswith("data:"):
            chunk = json.loads(line.removeprefix("data:"))
            assert "error" not in chunk, chunk
            tokens += chunk["choices"][0]["token_ids"] if chunk["choices"] else []
    return tokens


@functools.cache
def _greedy(model: str, prompt: str) -> list[int]:
    """HF's DUP_TOKENS greedy tokens after `prompt`, computed once per module."""
    tokenizer = AutoTokenizer.from_pretrained(model)
    return hf_greedy(Path(model), [tokenizer.encode(prompt)], DUP_TOKENS)[0]


def test_duplicate_request_id_through_proxy_fails_that_request(
    deployment: RemoteServer, tiny_model: Callable[[str], str]
) -> None:
    """pd_lessons 15: a client reuses the X-Request-Id of its request still streaming. The
    second request gets a 400 saying so, before either hop; the first streams on, token for
    token HF's, and the deployment serves the id again once it is free."""
    model = tiny_model("llama")
    prefill_side = instances(deployment)["prefill"][0]
    served = prefill_side.metric("request_success_total", finished_reason="length")
    body = {
        "model": model,
        "prompt": "dup",
        "max_tokens": DUP_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }
    headers = {"X-Request-Id": "dup-through-proxy"}
    url = f"{deployment.url}/v1/completions"
    with httpx.stream(
        "POST", url, json={**body, "stream": True}, headers=headers, timeout=60
    ) as resp:
        lines = resp.iter_lines()
        first = _stream_tokens(itertools.islice(lines, 2))
        second = httpx.post(url, json=body, headers=headers, timeout=60)
        assert second.status_code == 400
        assert "already in use" in second.json()["error"]["message"]
        first += _stream_tokens(lines)
    assert first == _greedy(model, "dup")
    again = httpx.post(url, json={**body, "max_tokens": 8}, headers=headers, timeout=60)
    assert again.status_code == 200 and again.json()["choices"][0]["token_ids"] == first[:8]
    wait_all_pools_full(deployment)
    # The duplicate reached no instance: the prefill side served the first and the last.
    assert prefill_side.metric("request_success_total", finished_reason="length") == served + 2


def test_duplicate_request_id_at_an_instance_fails_that_request(
    deployment: RemoteServer, tiny_model: Callable[[str], str]
) -> None:
    """pd_lessons 15, at the decode instance itself: a second request under the X-Request-Id
    of one in flight is refused with a 400 (not a server error), the prefill side's blocks
    it names are released at once rather than at the end of their lease, and the first
    request goes on."""
    model = tiny_model("llama")
    readers = instances(deployment)
    prefill_side, decode_side = readers["prefill"][0], readers["decode"][0]
    expired = prefill_side.metric("kv_expired_leases_total")
    body = {
        "model": model,
        "prompt": "dup",
        "max_tokens": DUP_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }
    url = f"{decode_side.url}/v1/completions"
    headers = {"X-Request-Id": "dup-at-decode"}
    params = prefill(prefill_side, {**body, "prompt": "another prompt"})
    with httpx.stream(
        "POST", url, json={**body, "stream": True}, headers=headers, timeout=60
    ) as resp:
        lines = resp.iter_lines()
        first = _stream_tokens(itertools.islice(lines, 2))
        second = httpx.post(
            url, json={**body, "kv_transfer_params": params}, headers=headers, timeout=60
        )
        assert second.status_code == 400, second.text
        assert "already in use" in second.json()["error"]["message"]
        first += _stream_tokens(lines)
    assert first == _greedy(model, "dup")
    wait_all_pools_full(deployment)
    assert prefill_side.metric("kv_expired_leases_total") == expired


def test_duplicate_remote_request_id_fails_that_request(
    deployment: RemoteServer, tiny_model: Callable[[str], str]
) -> None:
    """pd_lessons 15: two decode requests name one prefill hand-off (a replayed
    kv_transfer_params). The second is refused with a 400 naming the field, and does not
    release the blocks the first reads; the first's answer is HF's."""
    model = tiny_model("llama")
    readers = instances(deployment)
    prefill_side, decode_side = readers["prefill"][0], readers["decode"][0]
    body = {
        "model": model,
        "prompt": "one hand-off",
        "max_tokens": DUP_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }
    params = prefill(prefill_side, body)
    url = f"{decode_side.url}/v1/completions"
    replay = {**body, "kv_transfer_params": params}
    with httpx.stream(
        "POST",
        url,
        json={**replay, "stream": True},
        headers={"X-Request-Id": "reader-1"},
        timeout=60,
    ) as resp:
        lines = resp.iter_lines()
        first = _stream_tokens(itertools.islice(lines, 2))
        second = httpx.post(url, json=replay, headers={"X-Request-Id": "reader-2"}, timeout=60)
        assert second.status_code == 400, second.text
        error = second.json()["error"]
        assert error["param"] == "kv_transfer_params.remote_request_id"
        assert "already being read by request 'reader-1'" in error["message"]
        first += _stream_tokens(lines)
    assert first == _greedy(model, "one hand-off")
    wait_all_pools_full(deployment)


def test_launch_hands_its_instances_one_core_board(deployment: RemoteServer) -> None:
    """Each instance gets its slot on one board (executor/cpu_cores.py), which the launcher
    unlinked once they had mapped it: a killed launcher leaves no file behind."""
    boards = []
    for pid in descendants(deployment.proc.pid):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = f.read().split(b"\0")
        if b"serve" in args and b"pdserve.entrypoints.cli" in args:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
            boards.append(env[b"PDSERVE_CORE_BOARD"].decode().rpartition(":"))
    assert sorted(slot for _, _, slot in boards) == ["0", "1"]
    (path,) = {path for path, _, _ in boards}
    assert path.startswith("/dev/shm/pdserve-cores-") and not os.path.exists(path)


def test_kv_events_reach_a_proxy_s_routing(deployment: RemoteServer) -> None:
    """The KV-event chain end to end, over the deployment's instances: they publish, a second
    proxy finds their publishers through /server_info and follows them, and its decision reads
    what they hold. A prompt's blocks land on the decode instance by the split; the follow-up,
    three tokens longer, is short of --pd-min-uncached-tokens only if the proxy saw them there
    (without the events it counts all 43 tokens uncached and sends them to the prefill leg)."""
    health = httpx.get(f"{deployment.url}/health").json()
    args = ["proxy", "--pd-min-uncached-tokens", "24"]
    for role in ("prefill", "decode"):
        args += [f"--{role}", *(i["url"].removeprefix("http://") for i in health[role])]
    model = deployment.client().models.list().data[0].id
    body = {"model": model, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    prompt = [(i * 7) % 300 + 11 for i in range(40)]
    with RemoteServer(args) as proxy:
        _until(
            lambda: all(i["kv_events"] for r in ("prefill", "decode") for i in _health(proxy)[r])
        )
        first = httpx.post(f"{proxy.url}/v1/completions", json={**body, "prompt": prompt})
        assert first.headers["X-PD-Path"] == "remote", first.text
        # The decode instance's stored blocks reach the proxy within a step or two.
        follow_up = {**body, "prompt": prompt + [7, 8, 9]}
        path = lambda: httpx.post(f"{proxy.url}/v1/completions", json=follow_up)  # noqa: E731
        _until(lambda: path().headers["X-PD-Path"] == "local; reason=policy")
        resp = path()
        assert (
            resp.json()["choices"][0]["token_ids"]
            == hf_greedy(Path(model), [prompt + [7, 8, 9]], 3)[0]
        )
        assert proxy.stop() == []
    wait_all_pools_full(deployment)


def _health(server: RemoteServer) -> dict:
    return httpx.get(f"{server.url}/health", timeout=10).json()


def _until(done: Callable[[], bool], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"not reached in {timeout} s"
        time.sleep(0.1)


def _launch_pids(server: RemoteServer) -> list[int]:
    return [server.proc.pid, *descendants(server.proc.pid)]


@pytest.mark.slow  # launch's start-up: ~30 s each
def test_launch_stops_everything_on_sigterm(tiny_model: Callable[[str], str]) -> None:
    server = RemoteServer(["launch", "--model", tiny_model("llama"), "--dtype", "float32"])
    pids = _launch_pids(server)
    assert len(pids) >= 7, "launcher, 2 instances with their engines, the proxy"
    start = server.log_size()
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(60) == 0
    assert wait_until_gone(pids, 30) == []
    server.stop()
    assert server.complaints_since(start) == [], "an orderly stop logs at INFO"


@pytest.mark.slow  # launch's start-up: ~30 s each
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
