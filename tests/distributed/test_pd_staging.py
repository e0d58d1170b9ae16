"""Host staging through a prefill/decode split, the path a CUDA deployment with
kv_buffer_device "cpu" takes, run on CPU (host_staging forced on: cache and staging buffer
both CPU tensors, the copies the same): token-exact against HF with each transport, and on
every terminal path both instances' block pools and staging pools are full again."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.utils.faults import FaultPlan, rule
from tests.utils.pd import (
    greedy_body,
    post_and_hang_up_later,
    prefill,
    split_request,
    start_instance,
)
from tests.utils.server import RemoteServer, descendants
from tests.utils.tiny_models import hf_greedy

MAX_TOKENS = 8
# Under one block, exactly two blocks, and five blocks that the prefill side computes in
# three chunks (32 tokens a step): its staged copy is taken after the last one.
PROMPTS = [[7, 8, 9], list(range(10, 42)), [(i * 37) % 400 + 5 for i in range(75)]]


@pytest.fixture(scope="module")
def reference(tiny_model: Callable[[str], str]) -> list[list[int]]:
    return hf_greedy(Path(tiny_model("llama")), PROMPTS, MAX_TOKENS)


def _staged(model: str, role: str, transport: str = "nixl", **extra: Any) -> RemoteServer:
    return start_instance(
        model,
        role,
        transport,
        extra_args=["--max-num-batched-tokens", "32", "--max-num-seqs", "8"],
        kv_buffer_device="cpu",
        host_staging=True,
        **extra,
    )


def _wait_all_free(server: RemoteServer, timeout: float = 30.0) -> None:
    """Block pool full (invariant 2), and every staging block back."""
    server.wait_pool_full(timeout)
    deadline = time.monotonic() + timeout
    total = server.metric("kv_staging_total_blocks")
    assert total > 0, "no staging pool"
    while (free := server.metric("kv_staging_free_blocks")) != total:
        assert time.monotonic() < deadline, f"staging pool not full: {free} free of {total}"
        time.sleep(0.1)


# Slow (~40 s each): the default suite keeps host staging's unit tests
# (tests/unit/kv_connector/test_host_staging_*.py), with the connector's real halves.
@pytest.mark.slow
@pytest.mark.parametrize("transport", ["nixl", "ucx"])
def test_staged_split_matches_reference(
    tiny_model: Callable[[str], str], reference: list[list[int]], transport: str
) -> None:
    model = tiny_model("llama")
    servers = []
    try:
        p = _staged(model, "kv_producer", transport)
        servers.append(p)
        d = _staged(model, "kv_consumer", transport)
        servers.append(d)
        for prompt, expected in zip(PROMPTS, reference):
            resp = split_request(p, d, greedy_body(model, prompt, MAX_TOKENS))
            assert resp.status_code == 200, resp.text
            assert resp.json()["choices"][0]["token_ids"] == expected
        # Several at once: each holds its own staging blocks on both sides.
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            resps = list(
                pool.map(lambda q: split_request(p, d, greedy_body(model, q, MAX_TOKENS)), PROMPTS)
            )
        assert [r.json()["choices"][0]["token_ids"] for r in resps] == reference
        # The second two-block prompt finds both blocks in the decode side's prefix cache (with
        # the shipped first token after them, a whole prompt may be a hit): it reads nothing.
        assert d.metric("kv_transfers_total") == 2 * len(PROMPTS) - 1
        for server in servers:
            _wait_all_free(server)
        assert p.metric("kv_expired_leases_total") == 0
        # The staged requests' reads end in the connector: the scheduler never looks for them.
        assert "Unexpected finished KV send" not in p.read_log()
    finally:
        for server in servers:
            assert server.stop() == [], "processes left behind"


@pytest.mark.slow
def test_staging_freed_on_every_terminal_path(
    tiny_model: Callable[[str], str], reference: list[list[int]], tmp_path: Path
) -> None:
    """Read, aborted while reading, never read (lease over), and a prefill side that died
    after the handshake (the read fails)."""
    model = tiny_model("llama")
    d_plan = FaultPlan(tmp_path / "d")
    p = _staged(model, "kv_producer", kv_lease_duration=3)
    d = _staged(model, "kv_consumer", handshake_timeout=2, transfer_timeout=3, env=d_plan.env)
    try:
        resp = split_request(p, d, greedy_body(model, PROMPTS[2], MAX_TOKENS))
        assert resp.json()["choices"][0]["token_ids"] == reference[2]

        # The client goes away while its READ is held open: the abort waits for the READ, whose
        # done then frees both sides (not the lease).
        params = prefill(p, greedy_body(model, PROMPTS[1], MAX_TOKENS))  # not cached on D
        d_plan.set(rule("hold", "read", "delay", contains=params["remote_request_id"]))
        aborts = d.metric("request_success_total", finished_reason="abort")
        body = {**greedy_body(model, PROMPTS[1], 200), "kv_transfer_params": params}
        sock = post_and_hang_up_later(d, body)
        try:
            d_plan.wait_fired("hold")
        finally:
            sock.close()
        deadline = time.monotonic() + 30
        while d.metric("request_success_total", finished_reason="abort") == aborts:
            assert time.monotonic() < deadline, "the abort was not counted"
            time.sleep(0.05)
        d_plan.release("hold")
        _wait_all_free(d)
        _wait_all_free(p)
        assert p.metric("kv_expired_leases_total") == 0
        d_plan.set()

        prefill(p, greedy_body(model, PROMPTS[1], MAX_TOKENS))  # nobody reads it
        assert p.metric("kv_staging_free_blocks") < p.metric("kv_staging_total_blocks")
        p.wait_pool_full()  # the staged copy is what waits, not the device blocks
        _wait_all_free(p, timeout=20)
        assert p.metric("kv_expired_leases_total") == 1

        params = prefill(p, greedy_body(model, PROMPTS[2], MAX_TOKENS))
        for pid in [p.proc.pid, *descendants(p.proc.pid)]:
            os.kill(pid, signal.SIGKILL)
        resp = httpx.post(
            f"{d.url}/v1/completions",
            json={**greedy_body(model, PROMPTS[2], MAX_TOKENS), "kv_transfer_params": params},
            timeout=60,
        )
        assert resp.status_code == 500, resp.text
        assert d.metric("kv_failed_transfers_total") == 1
        _wait_all_free(d)
    finally:
        p.stop()
        assert d.stop() == []
