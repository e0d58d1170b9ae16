"""`pdserve serve` as a real process, driven by the official openai client (tiny llama)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.utils.server import RemoteServer, descendants
from tests.utils.tiny_models import hf_greedy, hf_logits, load_hf_model

MAX_MODEL_LEN = 1024
PROMPTS = ["hello there", "the quick brown fox", "a b c d e f g", "1 2 3 4 5 6 7 8 9 10 11"]


@pytest.fixture(scope="module")
def server(tiny_model: Callable[[str], str]) -> Iterator[RemoteServer]:
    with RemoteServer(
        [
            "serve",
            "--model",
            tiny_model("llama"),
            "--dtype",
            "float32",
            "--max-model-len",
            str(MAX_MODEL_LEN),
        ]
    ) as s:
        yield s
        # SIGTERM to every process at once, as `kill -- -PGID` or systemd sends it: an orderly
        # stop, logged at INFO (issue 27).
        start = s.log_size()
        for pid in [s.proc.pid, *descendants(s.proc.pid)]:
            os.kill(pid, signal.SIGTERM)
        assert s.proc.wait(60) == 0
        assert s.stop() == [], "processes left behind"
        assert s.complaints_since(start) == []


@pytest.fixture(scope="module")
def model(server: RemoteServer) -> str:
    return server.client().models.list().data[0].id


def test_completions_match_hf(
    server: RemoteServer, model: str, tiny_model: Callable[[str], str]
) -> None:
    client = server.client()
    resp = client.completions.create(
        model=model, prompt=PROMPTS, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    token_ids = [c.model_extra["token_ids"] for c in resp.choices]
    tok = _tokenizer(tiny_model("llama"))
    prompts_ids = [tok.encode(p) for p in PROMPTS]
    assert token_ids == hf_greedy(Path(tiny_model("llama")), prompts_ids, 12)
    assert resp.usage.prompt_tokens == sum(len(p) for p in prompts_ids)
    assert resp.usage.completion_tokens == 4 * 12
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 48
    # A prompt of token ids gives the same answer as its text.
    by_ids = client.completions.create(
        model=model,
        prompt=prompts_ids[1],
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert by_ids.choices[0].text == resp.choices[1].text


def _tokenizer(path: str):  # noqa: ANN202
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def test_streaming_joins_to_non_streaming(server: RemoteServer, model: str) -> None:
    client = server.client()
    for prompt in PROMPTS:
        full = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0)
        chunks = list(
            client.completions.create(
                model=model,
                prompt=prompt,
                max_tokens=16,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == full.choices[0].text
        assert (
            chunks[-1].choices == []
            and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
        )
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[
            0
        ].finish_reason


def test_chat_streaming_and_not(server: RemoteServer, model: str) -> None:
    client = server.client()
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    full = client.chat.completions.create(
        model=model, messages=messages, max_completion_tokens=10, temperature=0
    )
    assert full.choices[0].message.role == "assistant"
    assert full.usage.completion_tokens == len(full.choices[0].model_extra["token_ids"])
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


def test_usage_reports_cached_tokens(server: RemoteServer, model: str) -> None:
    """pd_lessons 17 on one instance: a repeated prompt's full blocks (16 tokens each, the last
    token always computed) are its cached_tokens, streamed or not, completion or chat; the
    instance's prompt_tokens_by_source add up to the prompts, its cache hits to those."""
    client = server.client()
    before = {s: server.metric("prompt_tokens_by_source_total", source=s) for s in SOURCES}
    prompt = [(i * 7) % 300 + 10 for i in range(40)]
    args = {"model": model, "max_tokens": 2, "temperature": 0}
    usages = [client.completions.create(prompt=prompt, **args).usage for _ in range(2)]
    assert [u.prompt_tokens_details.cached_tokens for u in usages] == [0, 32]
    chunks = list(
        client.completions.create(
            prompt=prompt, stream=True, stream_options={"include_usage": True}, **args
        )
    )
    usages.append(chunks[-1].usage)
    batch = client.completions.create(prompt=[prompt, [5] * 20], **args).usage
    usages.append(batch)
    assert [u.prompt_tokens_details.cached_tokens for u in usages[2:]] == [32, 32]
    messages = [{"role": "user", "content": "tell me " * 12}]
    chat = [client.chat.completions.create(messages=messages, **args).usage for _ in range(2)]
    streamed = list(
        client.chat.completions.create(
            messages=messages, stream=True, stream_options={"include_usage": True}, **args
        )
    )
    chat.append(streamed[-1].usage)
    full_blocks = (chat[0].prompt_tokens - 1) // 16 * 16
    assert full_blocks >= 16
    assert [u.prompt_tokens_details.cached_tokens for u in chat] == [0, full_blocks, full_blocks]
    usages += chat
    delta = {
        s: server.metric("prompt_tokens_by_source_total", source=s) - before[s] for s in SOURCES
    }
    assert sum(delta.values()) == sum(u.prompt_tokens for u in usages)
    assert delta["local_cache_hit"] == sum(u.prompt_tokens_details.cached_tokens for u in usages)
    assert delta["external_kv_transfer"] == 0


def test_cache_salt_keeps_hits_within_a_salt(server: RemoteServer, model: str) -> None:
    """vLLM's cache_salt on both endpoints: a request hits the blocks of earlier requests with
    its salt, never those of another salt or of none (40 tokens: two full blocks)."""
    client = server.client()
    prompt = [(i * 17) % 300 + 10 for i in range(40)]
    messages = [{"role": "user", "content": "keep it apart " * 6}]

    def cached(salt: str | None, chat: bool = False) -> int:
        args = {"model": model, "max_tokens": 2, "temperature": 0}
        extra = {} if salt is None else {"extra_body": {"cache_salt": salt}}
        if chat:
            usage = client.chat.completions.create(messages=messages, **args, **extra).usage
        else:
            usage = client.completions.create(prompt=prompt, **args, **extra).usage
        return usage.prompt_tokens_details.cached_tokens

    assert [cached(s) for s in ("tenant-a", "tenant-b", None, "tenant-a")] == [0, 0, 0, 32]
    chat = [cached(s, chat=True) for s in ("tenant-a", "tenant-b", None, "tenant-a")]
    assert chat[:3] == [0, 0, 0] and chat[3] >= 16
    bad = httpx.post(
        f"{server.url}/v1/completions",
        json={"model": model, "prompt": "hi", "cache_salt": ""},
        timeout=30,
    )
    assert bad.status_code == 400
    assert bad.json()["error"]["message"] == "cache_salt: must be a non-empty string if provided"


def test_n_logprobs_and_seed(server: RemoteServer, model: str) -> None:
    client = server.client()
    resp = client.completions.create(
        model=model, prompt="hello", max_tokens=8, n=3, temperature=1.0, seed=7, logprobs=2
    )
    assert sorted(c.index for c in resp.choices) == [0, 1, 2]
    assert len({c.text for c in resp.choices}) > 1, "three samples should not all agree"
    for c in resp.choices:
        assert len(c.logprobs.tokens) == len(c.model_extra["token_ids"])
        assert all(lp <= 0 for lp in c.logprobs.token_logprobs)
        # Keyed by text: two tokens that decode alike share a key.
        assert all(1 <= len(top) <= 3 for top in c.logprobs.top_logprobs)
    again = client.completions.create(
        model=model, prompt="hello", max_tokens=8, n=3, temperature=1.0, seed=7, logprobs=2
    )
    assert [c.text for c in again.choices] == [c.text for c in resp.choices]
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 3 for c in content)
    # Greedy: the sampled token is the most likely one.
    assert all(c.top_logprobs[0].logprob == pytest.approx(c.logprob) for c in content)


def _assert_top_close(got: dict[str, float], want: dict[str, float]) -> None:
    assert got.keys() == want.keys()
    assert list(got.values()) == pytest.approx(list(want.values()), abs=1e-5)


def test_echo_logprobs_and_prompt_logprobs(
    server: RemoteServer, model: str, tiny_model: Callable[[str], str]
) -> None:
    """echo with logprobs: the choice's logprobs start with the prompt's tokens (the first
    without a logprob), then the generated ones', offsets running on; vLLM's prompt_logprobs
    match HF transformers' log_softmax, for completions and chat, and a stream joins to the
    whole answer."""
    client = server.client()
    prompt, k, max_tokens = "The capital of France is Paris", 2, 4
    args = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    plain = client.completions.create(**args, logprobs=k).choices[0]
    echoed = client.completions.create(**args, logprobs=k, echo=True).choices[0]
    scored = client.completions.create(**args, extra_body={"prompt_logprobs": k}).choices[0]
    prompt_ids = _tokenizer(tiny_model("llama")).encode(prompt)
    num_prompt = len(prompt_ids)

    assert echoed.text == prompt + plain.text
    lp = echoed.logprobs
    assert len(lp.tokens) == num_prompt + max_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.tokens[num_prompt:] == plain.logprobs.tokens
    assert lp.token_logprobs[num_prompt:] == pytest.approx(plain.logprobs.token_logprobs, abs=1e-5)
    for got, want_top in zip(lp.top_logprobs[num_prompt:], plain.logprobs.top_logprobs):
        _assert_top_close(got, want_top)
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
    assert "".join(lp.tokens[:num_prompt]) == prompt

    table = scored.model_extra["prompt_logprobs"]
    assert len(table) == num_prompt and table[0] is None
    model_hf = load_hf_model(Path(tiny_model("llama")))
    ref = hf_logits(model_hf, prompt_ids).log_softmax(dim=-1)
    for pos in range(1, num_prompt):
        entries, token = table[pos], prompt_ids[pos]
        want = ref[pos - 1]
        top = want.topk(k).indices.tolist()
        assert list(entries) == [str(t) for t in dict.fromkeys([token, *top])]
        assert entries[str(token)]["rank"] == int((want >= want[token]).sum())
        assert entries[str(token)]["logprob"] == pytest.approx(float(want[token]), abs=1e-4)
        assert entries[str(token)]["decoded_token"] == lp.tokens[pos]
        # echo's prompt entries are the same numbers.
        assert lp.token_logprobs[pos] == pytest.approx(entries[str(token)]["logprob"], abs=1e-5)
        _assert_top_close(
            lp.top_logprobs[pos], {e["decoded_token"]: e["logprob"] for e in entries.values()}
        )

    chunks = list(client.completions.create(**args, logprobs=k, echo=True, stream=True))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == echoed.text
    joined = {
        field: [x for chunk in streamed for x in getattr(chunk, field)]
        for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    }
    assert joined["token_logprobs"][0] is None
    assert joined["token_logprobs"][1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)
    assert (joined["tokens"], joined["text_offset"]) == (lp.tokens, lp.text_offset)
    assert joined["top_logprobs"][0] is None
    for got, want_top in zip(joined["top_logprobs"][1:], lp.top_logprobs[1:]):
        _assert_top_close(got, want_top)

    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=2,
        extra_body={"prompt_logprobs": 0},
    )
    table = chat.model_extra["prompt_logprobs"]
    assert len(table) == chat.usage.prompt_tokens and table[0] is None
    assert all(len(entries) == 1 for entries in table[1:])


def test_stop_strings(server: RemoteServer, model: str) -> None:
    client = server.client()
    base = (
        client.completions.create(
            model=model,
            prompt="the quick",
            max_tokens=20,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        .choices[0]
        .text
    )
    stop = base[len(base) // 2 : len(base) // 2 + 2]
    assert stop.strip(), f"need a visible stop string in {base!r}"
    resp = client.completions.create(
        model=model,
        prompt="the quick",
        max_tokens=20,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == stop
    assert choice.text == base[: base.index(stop)]


def test_64_concurrent_requests(
    server: RemoteServer, model: str, tiny_model: Callable[[str], str]
) -> None:
    """Each of 64 requests batched together gets HF's greedy answer to its own prompt: no
    request sees another's KV, whatever ran beside it."""
    prompts = [f"request number {i}" for i in range(64)]
    tok = _tokenizer(tiny_model("llama"))
    reference = hf_greedy(Path(tiny_model("llama")), [tok.encode(p) for p in prompts], 10)
    server.wait_pool_full()
    done = server.metric("request_success_total", finished_reason="length")

    async def run() -> list[openai.types.Completion]:
        client = server.async_client()
        return await asyncio.gather(
            *[
                client.completions.create(
                    model=model,
                    prompt=p,
                    max_tokens=10,
                    temperature=0,
                    extra_body={"ignore_eos": True},
                )
                for p in prompts
            ]
        )

    results = asyncio.run(run())
    assert [r.choices[0].model_extra["token_ids"] for r in results] == reference
    assert all(r.usage.completion_tokens == 10 for r in results)
    server.wait_pool_full()
    assert server.metric("request_success_total", finished_reason="length") == done + 64


def test_client_disconnect_mid_stream_aborts(server: RemoteServer, model: str) -> None:
    server.wait_pool_full()
    aborted = server.metric("request_success_total", finished_reason="abort")
    body = {
        "model": model,
        "prompt": "a long one",
        "max_tokens": MAX_MODEL_LEN - 16,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as resp:
        lines = resp.iter_lines()
        got = [line for line, _ in zip(lines, range(6)) if line.startswith("data:")]
        assert got
        assert server.metric("num_requests_running") == 1
    server.wait_pool_full(timeout=20)
    assert server.metric("request_success_total", finished_reason="abort") == aborted + 1
    aborted += 1
    # A non-streaming request whose client gives up is aborted too.
    aborted = server.metric("request_success_total", finished_reason="abort")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json={**body, "stream": False}, timeout=0.5)
    server.wait_pool_full(timeout=20)
    assert server.metric("request_success_total", finished_reason="abort") == aborted + 1


BAD_REQUESTS = [
    ("not json", b'{"prompt": "hel', None),
    ("wrong type", {"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
    ("prompt type", {"prompt": {"text": "hi"}}, "prompt"),
    ("max_tokens=0", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("temperature=-1", {"prompt": "hi", "temperature": -1}, "temperature"),
    ("n=0", {"prompt": "hi", "n": 0}, "n"),
    # vLLM refuses an empty stop string too; the schema says so (minLength 1), which fuzzing
    # the proxy found it did not.
    ("empty stop string", {"prompt": "hi", "stop": ""}, "stop"),
    ("empty cache_salt", {"prompt": "hi", "cache_salt": ""}, "cache_salt"),
    (
        "cache_salt not a string",
        {"messages": [{"role": "user", "content": "hi"}], "cache_salt": 5},
        "cache_salt",
    ),
    ("prompt too long", {"prompt": [5] * MAX_MODEL_LEN}, "prompt"),
    ("prompt + max_tokens too long", {"prompt": [5] * 1000, "max_tokens": 100}, "max_tokens"),
    ("token id out of vocab", {"prompt": [10**7]}, "prompt"),
    (
        "kv_transfer_params not an object",
        {"prompt": "hi", "kv_transfer_params": "yes"},
        "kv_transfer_params",
    ),
    (
        "kv_transfer_params bad field",
        {"prompt": "hi", "kv_transfer_params": {"do_remote_decode": "yes"}},
        "kv_transfer_params",
    ),
    (
        "kv_transfer_params bad block ids",
        {"prompt": "hi", "kv_transfer_params": {"remote_block_ids": [1, "x"]}},
        "kv_transfer_params",
    ),
    (
        "kv_transfer_params bad cached tokens",
        {"prompt": "hi", "kv_transfer_params": {"remote_cached_tokens": "32"}},
        "kv_transfer_params",
    ),
    ("empty messages", {"messages": []}, "messages"),
    ("prompt_logprobs=-1", {"prompt": "hi", "prompt_logprobs": -1}, "prompt_logprobs"),
    ("prompt_logprobs=21", {"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
    (
        "prompt_logprobs streamed",
        {"prompt": "hi", "prompt_logprobs": 1, "stream": True},
        "prompt_logprobs",
    ),
    (
        "chat prompt_logprobs streamed",
        {"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 2, "stream": True},
        "prompt_logprobs",
    ),
    (
        "prompt_logprobs of a prompt computed elsewhere",
        {"prompt": "hi", "prompt_logprobs": 1, "kv_transfer_params": {"do_remote_prefill": True}},
        "prompt_logprobs",
    ),
]


@pytest.mark.parametrize("name,body,param", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_input_is_400(
    server: RemoteServer, model: str, name: str, body: object, param: str | None
) -> None:
    endpoint = (
        "chat/completions" if isinstance(body, dict) and "messages" in body else "completions"
    )
    content = body if isinstance(body, bytes) else json.dumps({"model": model, **body}).encode()
    resp = httpx.post(
        f"{server.url}/v1/{endpoint}",
        content=content,
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["message"] and error["code"] == 400
    if param is not None:
        assert error["param"] is not None and error["param"].startswith(param), error
    # ... and the server still serves.
    ok = server.client().completions.create(model=model, prompt="hi", max_tokens=2)
    assert ok.usage.completion_tokens == 2


def test_unknown_model_is_404_and_openai_client_sees_400(server: RemoteServer, model: str) -> None:
    client = server.client()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=model, prompt="hi", temperature=-1)


def test_health_version_models(server: RemoteServer, model: str) -> None:
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/version").json()["version"]
    card = httpx.get(f"{server.url}/v1/models").json()["data"][0]
    assert card["id"] == model and card["max_model_len"] == MAX_MODEL_LEN
    text = httpx.get(f"{server.url}/metrics").text
    for name in (
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "prefix_cache_hits_total",
        "prompt_tokens_total",
        "generation_tokens_total",
        "num_preemptions_total",
        "time_to_first_token_seconds_bucket",
        "inter_token_latency_seconds_bucket",
        "e2e_request_latency_seconds_bucket",
        "request_success_total",
    ):
        assert f"pdserve:{name}" in text, name


def test_api_key_and_overload(tiny_model: Callable[[str], str]) -> None:
    """Also: `serve` takes the model as its positional argument, as `vllm serve` does."""
    with RemoteServer(
        ["serve", tiny_model("llama"), "--dtype", "float32", "--max-pending-requests", "1"],
        api_key="sekrit",
    ) as server:
        assert httpx.get(f"{server.url}/health").status_code == 200
        for path in ("/v1/models", "/metrics", "/version"):
            resp = httpx.get(f"{server.url}{path}")
            assert resp.status_code == 401 and resp.json()["error"]["type"] == "AuthenticationError"
        with pytest.raises(openai.AuthenticationError):
            server.client(api_key="wrong").models.list()
        client = server.client(api_key="sekrit")
        model = client.models.list().data[0].id
        assert model == tiny_model("llama")

        async def burst() -> list[object]:
            aclient = server.async_client(api_key="sekrit")
            return await asyncio.gather(
                *[
                    aclient.completions.create(
                        model=model, prompt=f"p{i}", max_tokens=300, extra_body={"ignore_eos": True}
                    )
                    for i in range(8)
                ],
                return_exceptions=True,
            )

        results = asyncio.run(burst())
        busy = [r for r in results if isinstance(r, openai.APIStatusError)]
        assert busy and all(r.status_code == 503 and "overloaded" in r.message for r in busy), (
            results
        )
        assert len(busy) < len(results), "the first request is served"
        server.wait_pool_full()
        assert (
            client.completions.create(model=model, prompt="y", max_tokens=2).usage.completion_tokens
            == 2
        )
        assert server.stop() == []


def test_engine_killed_fails_requests_and_health(tiny_model: Callable[[str], str]) -> None:
    server = RemoteServer(["serve", "--model", tiny_model("llama"), "--dtype", "float32"])
    try:
        model = server.client().models.list().data[0].id
        engine_pids = descendants(server.proc.pid)
        assert engine_pids, "the engine runs in its own process"
        body = {
            "model": model,
            "prompt": "x",
            "max_tokens": 1000,
            "ignore_eos": True,
            "stream": True,
        }
        timeout = httpx.Timeout(30, read=10)
        with httpx.stream(
            "POST", f"{server.url}/v1/completions", json=body, timeout=timeout
        ) as resp:
            lines = resp.iter_lines()
            next(lines)
            for pid in engine_pids:
                os.kill(pid, signal.SIGKILL)
            # The stream's 10 s read timeout bounds how long the server may take to notice.
            rest = [line for line in lines if line.startswith("data:")]
        assert any('"error"' in line for line in rest), rest[-3:]
        assert rest[-1] == "data: [DONE]"
        health = httpx.get(f"{server.url}/health")
        assert (
            health.status_code == 503 and "exited unexpectedly" in health.json()["error"]["message"]
        )
        with pytest.raises(openai.APIStatusError) as dead:
            server.client().completions.create(model=model, prompt="y", max_tokens=2)
        assert dead.value.status_code == 503
        assert "exited unexpectedly" in server.read_log()
    finally:
        assert server.stop() == [], "processes left behind"


def test_render_gives_the_token_ids_a_request_would_run_with(
    server: RemoteServer, model: str
) -> None:
    """vLLM's render endpoints (routers tokenize through them): no generation, the prompt's
    token ids as the completion would use them; a bad request is a 400 there too."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    rendered = httpx.post(
        f"{server.url}/v1/completions/render",
        json={"model": model, "prompt": [PROMPTS[1], PROMPTS[2]], "max_tokens": 5},
        headers={"X-Request-Id": "r1"},
    )
    assert rendered.status_code == 200
    first, second = rendered.json()
    assert first["request_id"] == "r1-0" and second["request_id"] == "r1-1"
    assert first["token_ids"] == tokenizer.encode(PROMPTS[1])
    assert second["token_ids"] == tokenizer.encode(PROMPTS[2])
    assert first["sampling_params"]["max_tokens"] == 5 and first["model"] == model
    messages = [{"role": "user", "content": "hello"}]
    chat = httpx.post(
        f"{server.url}/v1/chat/completions/render", json={"model": model, "messages": messages}
    )
    assert chat.status_code == 200
    templated = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert chat.json()["token_ids"] == tokenizer.encode(templated, add_special_tokens=False)
    bad = httpx.post(f"{server.url}/v1/completions/render", json={"model": model, "prompt": ""})
    assert bad.status_code == 400 and bad.json()["error"]["message"]


def test_server_info_has_what_routers_read(server: RemoteServer) -> None:
    info = httpx.get(f"{server.url}/server_info", params={"config_format": "json"}).json()
    config = info["vllm_config"]
    assert config["cache_config"]["block_size"] == 16
    assert config["model_config"]["max_model_len"] == MAX_MODEL_LEN
    assert config["kv_events_config"] is None
    text = httpx.get(f"{server.url}/server_info").json()["vllm_config"]
    assert isinstance(text, str) and "block_size" in text


UNSUPPORTED_ON = [
    ("chat", "functions", [{"name": "f", "parameters": {}}]),
    ("completions", "logit_bias", {"5": 10}),
    ("completions", "best_of", 3),
    ("completions", "use_beam_search", True),
    ("completions", "suffix", " and so on"),
]


@pytest.mark.parametrize(("endpoint", "field", "value"), UNSUPPORTED_ON)
def test_a_field_not_implemented_yet_is_refused_by_name(
    server: RemoteServer, model: str, endpoint: str, field: str, value: object
) -> None:
    """Never a 200 that silently ignores it (prose for a schema, no call for a named tool)."""
    body: dict = {"model": model, "max_tokens": 2, field: value}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": "hi"}]
        url = f"{server.url}/v1/chat/completions"
    else:
        body["prompt"] = "hi"
        url = f"{server.url}/v1/completions"
    resp = httpx.post(url, json=body, timeout=30)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == field and "not supported by pdserve yet" in error["message"]


def test_auto_tool_choice_needs_the_servers_parser(server: RemoteServer, model: str) -> None:
    """vLLM's refusal: tools (tool_choice "auto" by default) on a server started without
    --enable-auto-tool-choice --tool-call-parser."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for extra in ({}, {"tool_choice": "auto"}):
        resp = httpx.post(
            f"{server.url}/v1/chat/completions",
            json={"model": model, "messages": [{"role": "user", "content": "hi"}], "tools": tools}
            | extra,
            timeout=30,
        )
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["param"] == "tool_choice"
        assert "requires --enable-auto-tool-choice and --tool-call-parser" in error["message"]


def test_a_field_sent_off_is_accepted(server: RemoteServer, model: str) -> None:
    """What client libraries send as defaults leaves the features off: no refusal."""
    client = server.client()
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        response_format={"type": "text"},
        tool_choice="none",
        tools=[],
    )
    assert chat.choices[0].finish_reason == "length"
    completion = client.completions.create(model=model, prompt="hi", max_tokens=2, best_of=1)
    assert completion.choices[0].finish_reason == "length"


def test_tokenize_and_detokenize(server: RemoteServer, model: str) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    ids = tokenizer.encode(PROMPTS[1])
    got = httpx.post(
        f"{server.url}/tokenize",
        json={"model": model, "prompt": PROMPTS[1], "return_token_strs": True},
    ).json()
    assert got["tokens"] == ids and got["count"] == len(ids)
    assert got["max_model_len"] == MAX_MODEL_LEN
    assert got["token_strs"] == tokenizer.convert_ids_to_tokens(ids)
    messages = [{"role": "user", "content": "hello"}]
    chat = httpx.post(f"{server.url}/tokenize", json={"model": model, "messages": messages}).json()
    rendered = httpx.post(
        f"{server.url}/v1/chat/completions/render", json={"model": model, "messages": messages}
    ).json()
    assert chat["tokens"] == rendered["token_ids"] and chat["token_strs"] is None
    text = httpx.post(f"{server.url}/detokenize", json={"model": model, "tokens": ids}).json()
    assert text == {"prompt": tokenizer.decode(ids)}
    both = httpx.post(
        f"{server.url}/tokenize", json={"model": model, "prompt": "a", "messages": messages}
    )
    # Each form of the body leaves the other's field out (the schema says so too).
    assert both.status_code == 400 and both.json()["error"]["param"] in ("prompt", "messages")
    outside = httpx.post(f"{server.url}/detokenize", json={"model": model, "tokens": [10**7]})
    assert outside.status_code == 400 and outside.json()["error"]["param"] == "tokens"
    wrong = httpx.post(f"{server.url}/tokenize", json={"model": "nope", "prompt": "a"})
    assert wrong.status_code == 404


def test_openapi_schema_says_what_the_server_does(server: RemoteServer) -> None:
    schema = httpx.get(f"{server.url}/openapi.json")
    assert schema.status_code == 200  # kv_transfer_params' struct once made it a 500
    paths = schema.json()["paths"]
    completions = paths["/v1/completions"]["post"]["responses"]
    assert {"200", "400", "401", "404", "503"} <= set(completions) and "422" not in completions
    metrics_types = list(paths["/metrics"]["get"]["responses"]["200"]["content"])
    assert all(t.startswith("text/plain") for t in metrics_types), metrics_types
    health = httpx.get(f"{server.url}/health")
    assert health.status_code == 200 and health.content == b""
    assert "application/json" not in health.headers.get("content-type", "")
    assert "text/plain" in httpx.get(f"{server.url}/metrics").headers["content-type"]
    wrong = httpx.get(f"{server.url}/v1/completions")
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
    assert wrong.json()["error"]["type"] == "MethodNotAllowedError"


@pytest.mark.parametrize(
    ("field", "value"),
    [("max_tokens", 2.5), ("skip_special_tokens", "true"), ("prompt", [[1, 2.5]]), ("n", "1")],
)
def test_a_value_of_another_type_is_not_coerced(
    server: RemoteServer, model: str, field: str, value: object
) -> None:
    """What the schema says is what is taken: no "true" for a bool, no 2.5 for a token id.
    JSON Schema's integer includes 2.0, so that is taken as 2."""
    body = {"model": model, "prompt": "hi", "max_tokens": 2, field: value}
    resp = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"].split(".")[0] == field
    integral = {"model": model, "prompt": [[1, 2.0]], "max_tokens": 2.0, "temperature": 0}
    resp = httpx.post(f"{server.url}/v1/completions", json=integral, timeout=30)
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 2
