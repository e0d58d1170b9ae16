"""PD lessons that need heterogeneous TP (two worker processes on one side), with fault plans:
one failed READ among several ends the request everywhere, and only once every READ of it has
ended (pd_lessons 23)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.utils.faults import FaultPlan, rule
from tests.utils.pd import prefill, split_request, start_instance
from tests.utils.server import start_together
from tests.utils.tiny_models import hf_greedy

pytestmark = pytest.mark.slow

LEASE = 3
PROMPT = [(i * 23) % 500 + 3 for i in range(70)]
AFTER = [(i * 29) % 500 + 3 for i in range(40)]


def _body(model: str, prompt: list[int]) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}


@pytest.mark.parametrize(
    "prefill_tp, decode_tp, failed, held",
    [
        # Two decode ranks read the one prefill rank: rank 1's READ fails, rank 0's is held.
        pytest.param(1, 2, {"agent": ":1"}, {"agent": ":0"}, id="decode-ranks"),
        # One decode rank reads two prefill ranks: the READ from rank 0 fails, from 1 is held.
        pytest.param(2, 1, {"peer": ":0"}, {"peer": ":1"}, id="prefill-ranks"),
    ],
)
def test_one_failed_read_under_heterogeneous_tp_ends_the_request_once(
    tiny_model: Callable[[str], str],
    tmp_path: Path,
    prefill_tp: int,
    decode_tp: int,
    failed: dict[str, str],
    held: dict[str, str],
) -> None:
    """pd_lessons 23: one READ of a request fails while another is still landing: the request
    fails (policy fail) for every rank, but its blocks stay held until that READ ended too,
    and are freed once: the pool is exactly full and the next request is HF-exact."""
    model = tiny_model("llama")
    plan = FaultPlan(tmp_path / "plan")
    p, d = start_together(
        lambda: start_instance(model, "kv_producer", tp=prefill_tp, kv_lease_duration=LEASE),
        lambda: start_instance(model, "kv_consumer", tp=decode_tp, env=plan.env),
    )
    try:
        params = prefill(p, _body(model, PROMPT))
        remote_id = params["remote_request_id"]
        plan.set(
            rule("fail", "read", "fail", contains=remote_id, **failed),
            rule("hold", "read", "delay", contains=remote_id, **held),
            # One heartbeat a step of the decode side's rank 0 to the prefill side's rank 0.
            rule(
                "beat", "send_notif", "pass", contains="heartbeat", agent=":0", peer=":0", count=0
            ),
        )
        with ThreadPoolExecutor(1) as pool:
            body = {**_body(model, PROMPT), "kv_transfer_params": params}
            done = pool.submit(httpx.post, f"{d.url}/v1/completions", json=body, timeout=120)
            plan.wait_fired("fail")
            plan.wait_fired("hold")
            # The first heartbeat goes out before the READs are posted: after the third, the
            # decode side has polled its READs since the failure.
            plan.wait_fired("beat", 3)
            if decode_tp > 1:  # the failed rank reported it: the request may have ended
                assert d.metric("kv_failed_transfers_total") == 1
            # A READ of the request still lands in its blocks: they stay held.
            assert d.metric("kv_cache_free_blocks") < d.metric("kv_cache_total_blocks") - 1
            plan.release("hold")
            resp = done.result()
        assert resp.status_code == 500, resp.text
        assert "KV cache could not be loaded" in resp.json()["error"]["message"]
        assert d.metric("kv_failed_transfers_total") == 1
        d.wait_pool_full()
        p.wait_pool_full(timeout=30)
        plan.set()
        (expected,) = hf_greedy(Path(model), [AFTER], 6)
        resp = split_request(p, d, _body(model, AFTER))
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["token_ids"] == expected
        for server in (p, d):
            server.wait_pool_full()
    finally:
        assert d.stop() == [] and p.stop() == []
