"""SIGTERM drains an instance: /health says "draining" at once, new requests get 503, requests
in flight finish, KV held for a reader is read before the prefill instance exits; behind the
proxy, a rolling restart of one of two decode instances under load loses no request."""

from __future__ import annotations

import asyncio
import random
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.utils.faults import FaultPlan, rule
from tests.utils.pd import greedy_body, prefill, start_instance
from tests.utils.procs import wait_until_gone
from tests.utils.server import RemoteServer, start_together
from tests.utils.tiny_models import hf_greedy

MAX_TOKENS = 6
# Longer than the test waits for the exit: an exit by the timeout fails it.
DRAIN_60S = ["--drain-timeout", "60"]


@pytest.fixture(scope="module")
def model(tiny_model: Callable[[str], str]) -> str:
    return tiny_model("llama")


def test_sigterm_drains_then_exits(model: str) -> None:
    server = RemoteServer(["serve", "--model", model, "--dtype", "float32"])
    try:
        results: list[tuple[int, int]] = []

        def long_request() -> None:
            body = {**greedy_body(model, [5, 6, 7], 300)}
            resp = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
            results.append((resp.status_code, len(resp.json()["choices"][0]["token_ids"])))

        threads = [threading.Thread(target=long_request) for _ in range(6)]
        for t in threads:
            t.start()
        # All six admitted before the signal: a request arriving after it is refused.
        deadline = time.monotonic() + 30
        while server.metric("num_requests_running") < 6 and time.monotonic() < deadline:
            time.sleep(0.01)
        server.proc.send_signal(signal.SIGTERM)
        health = httpx.get(f"{server.url}/health", timeout=5)
        assert health.status_code == 503 and health.json() == {"status": "draining"}
        refused = httpx.post(
            f"{server.url}/v1/completions", json=greedy_body(model, [1, 2], 2), timeout=5
        )
        assert refused.status_code == 503 and "draining" in refused.json()["error"]["message"]
        for t in threads:
            t.join(60)
        assert results == [(200, 300)] * 6
        assert server.proc.wait(30) == 0
        assert wait_until_gone(server.all_pids, 10) == []
    finally:
        server.stop()


@pytest.mark.slow  # 30 s; the default stage drains a single instance (test_sigterm_drains_then_exits)
def test_prefill_instance_keeps_held_kv_until_it_is_read(model: str) -> None:
    p, d = start_together(
        lambda: start_instance(model, "kv_producer"),
        lambda: start_instance(model, "kv_consumer"),
    )
    with p, d:
        prompt = list(range(20, 60))
        body = greedy_body(model, prompt, MAX_TOKENS)
        params = prefill(p, body)  # its blocks are held for the decode instance now
        p.proc.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        assert p.proc.poll() is None, "exited with KV still held for a reader"
        resp = httpx.post(
            f"{d.url}/v1/completions", json={**body, "kv_transfer_params": params}, timeout=60
        )
        assert resp.status_code == 200
        assert (
            resp.json()["choices"][0]["token_ids"]
            == hf_greedy(Path(model), [prompt], MAX_TOKENS)[0]
        )
        assert p.proc.wait(30) == 0
        d.wait_pool_full()


@pytest.mark.slow  # 20 s, on an instance of its own: SIGTERM ends it
def test_decode_instance_drains_a_request_waiting_for_its_kv(model: str, tmp_path: Path) -> None:
    """SIGTERM reaches a decode instance while a request's READ is in flight (held open by the
    fault transport): the drain waits for the request, which ends with HF's tokens once the READ
    does; the instance then exits 0, well before its drain timeout, and the prefill instance's
    blocks come back by the read, not by their lease."""
    plan = FaultPlan(tmp_path / "d")
    p, d = start_together(
        lambda: start_instance(model, "kv_producer"),
        lambda: start_instance(model, "kv_consumer", env=plan.env, extra_args=DRAIN_60S),
    )
    with p, d:
        prompt = list(range(60, 100))
        body = greedy_body(model, prompt, MAX_TOKENS)
        params = prefill(p, body)
        plan.set(rule("hold", "read", "delay", contains=params["remote_request_id"]))
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(
                httpx.post,
                f"{d.url}/v1/completions",
                json={**body, "kv_transfer_params": params},
                timeout=60,
            )
            plan.wait_fired("hold")
            d.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 10
            while httpx.get(f"{d.url}/health", timeout=5).status_code != 503:
                assert time.monotonic() < deadline, "not draining"
                time.sleep(0.1)
            time.sleep(1.0)
            assert d.proc.poll() is None, "exited with a request waiting for its KV"
            plan.release("hold")
            resp = answer.result()
        assert resp.status_code == 200, resp.text
        assert (
            resp.json()["choices"][0]["token_ids"]
            == hf_greedy(Path(model), [prompt], MAX_TOKENS)[0]
        )
        assert d.proc.wait(30) == 0
        p.wait_pool_full()
        assert p.metric("kv_expired_leases_total") == 0


@pytest.mark.slow  # over a minute on 2 cores: the default stage stays under 15
def test_rolling_restart_of_a_decode_instance_loses_no_request(model: str) -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 250) for _ in range(24)] for _ in range(6)]
    reference = hf_greedy(Path(model), prompts, MAX_TOKENS)
    num_requests = 120
    p, d1, d2 = start_together(
        lambda: start_instance(model, "kv_producer"),
        lambda: start_instance(model, "kv_consumer"),
        lambda: start_instance(model, "kv_consumer"),
    )
    with p, d1, d2:
        addresses = {s: s.url.removeprefix("http://") for s in (p, d1, d2)}
        args = ["proxy", "--prefill", addresses[p], "--decode", addresses[d1], addresses[d2]]
        args += ["--pd-min-uncached-tokens", "0"]  # both legs for every request
        with RemoteServer(args) as proxy:
            results: list[tuple[int, list[int] | str, int]] = []
            back = threading.Event()

            async def load() -> None:
                """Six clients, one request after another, until the restarted instance has
                served for a while and at least `num_requests` went out."""
                async with httpx.AsyncClient(base_url=proxy.url, timeout=120) as client:

                    async def client_loop(c: int) -> None:
                        i = c
                        while not back.is_set() or len(results) < num_requests:
                            body = greedy_body(model, prompts[i % len(prompts)], MAX_TOKENS)
                            resp = await client.post("/v1/completions", json=body)
                            out = (
                                resp.json()["choices"][0]["token_ids"]
                                if resp.is_success
                                else resp.text
                            )
                            results.append((i, out, resp.status_code))
                            i += 6
                            await asyncio.sleep(0.05)

                    await asyncio.gather(*(client_loop(c) for c in range(6)))

            runner = threading.Thread(target=asyncio.run, args=(load(),))
            runner.start()
            time.sleep(1.0)
            # The restart: drain d1 to its exit, then start it again on its port.
            d1.proc.send_signal(signal.SIGTERM)
            assert d1.proc.wait(60) == 0
            d1.stop()
            with start_instance(model, "kv_consumer", port=d1.port) as d1_again:
                time.sleep(4.0)  # the proxy's health check finds it back; it takes requests
                back.set()
                runner.join(300)
                assert len(results) >= num_requests
                failed = [(i, out, status) for i, out, status in results if status != 200]
                assert failed == []
                assert all(out == reference[i % len(prompts)] for i, out, _ in results)
                assert d1_again.metric("request_success_total", finished_reason="length") > 0
                for server in (p, d2, d1_again):
                    server.wait_pool_full()
            assert proxy.stop() == []
