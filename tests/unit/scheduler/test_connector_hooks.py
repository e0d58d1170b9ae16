"""Where the scheduler calls a KV connector, checked with a minimal fake one (the NIXL
connector and its own tests come later): remote prefill on the decode side, delayed freeing
on the prefill side (reference §4.2, §4.4, §4.5)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from pdserve.outputs import EMPTY_MODEL_RUNNER_OUTPUT, KVConnectorOutput, ModelRunnerOutput
from pdserve.request import FinishReason, Request, RequestStatus
from pdserve.scheduler.block_pool import KVCacheBlock
from pdserve.scheduler.output import SchedulerOutput
from pdserve.scheduler.scheduler import Scheduler

from .conftest import EOS, make_request, runner_output, step

MakeScheduler = Callable[..., Scheduler]


class FakeConnector:
    """Loads a remote prompt asynchronously (decode side); holds blocks while sending (prefill)."""

    def __init__(self) -> None:
        self.reqs_to_recv: dict[str, list[int]] = {}
        self.connector_outputs: list[KVConnectorOutput] = []

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        params = request.kv_transfer_params or {}
        if params.get("do_remote_prefill"):
            count = request.num_prompt_tokens - num_computed_tokens
            if count > 0:
                return count, True
        return 0, False

    def update_state_after_alloc(
        self, request: Request, blocks: list[KVCacheBlock], num_external_tokens: int
    ) -> None:
        params = request.kv_transfer_params or {}
        if params.get("do_remote_prefill"):
            self.reqs_to_recv[request.request_id] = [b.block_id for b in blocks]
            params["do_remote_prefill"] = False  # one transfer per request

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> dict[str, Any]:
        meta = {"reqs_to_recv": self.reqs_to_recv}
        self.reqs_to_recv = {}
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params or {}
        if not params.get("do_remote_decode") or request.status == RequestStatus.FINISHED_ABORTED:
            return False, None
        return True, {"do_remote_prefill": True, "remote_block_ids": block_ids}

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.connector_outputs.append(connector_output)


def kv_output(**kv: set[str]) -> ModelRunnerOutput:
    return ModelRunnerOutput(
        req_ids=[],
        req_id_to_index={},
        sampled_token_ids=[],
        kv_connector_output=KVConnectorOutput(**kv),
    )


def remote_prefill_request(request_id: str, num_tokens: int) -> Request:
    request = make_request(request_id, prompt=num_tokens)
    request.kv_transfer_params = {"do_remote_prefill": True, "remote_block_ids": [1, 2, 3]}
    return request


def test_remote_prefill_lifecycle(make_scheduler: MakeScheduler) -> None:
    connector = FakeConnector()
    scheduler = make_scheduler(block_size=16, kv_connector=connector)
    request = remote_prefill_request("d", 40)
    scheduler.add_request(request)

    out = scheduler.schedule()  # blocks for the transfer; nothing for the workers to run
    assert out.total_num_scheduled_tokens == 0 and not out.scheduled_new_reqs
    assert out.kv_connector_metadata is not None
    assert msgspec.msgpack.decode(out.kv_connector_metadata) == {
        "reqs_to_recv": {"d": scheduler.kv_cache_manager.get_block_ids("d")}
    }
    assert (
        request.status == RequestStatus.WAITING_FOR_REMOTE_KVS and request.num_computed_tokens == 40
    )
    assert list(scheduler.skipped_waiting) == [request]
    blocks = scheduler.kv_cache_manager.get_blocks("d")
    assert len(blocks) == 3 and all(b.block_hash is None for b in blocks)  # not filled yet
    assert scheduler.update_from_output(out, EMPTY_MODEL_RUNNER_OUTPUT) == []

    out = scheduler.schedule()
    assert out.total_num_scheduled_tokens == 0
    assert scheduler.update_from_output(out, kv_output(finished_recving={"d"})) == []
    assert scheduler.finished_recving_kv_req_ids == {"d"} and connector.connector_outputs

    out = scheduler.schedule()  # promoted: the whole prompt arrived, its last token is recomputed
    assert [r.req_id for r in out.scheduled_new_reqs] == ["d"]
    assert out.scheduled_new_reqs[0].num_computed_tokens == 39 and out.num_scheduled_tokens == {
        "d": 1
    }
    assert (
        sum(b.block_hash is not None for b in blocks) == 2
        and len(scheduler.kv_cache_manager.get_blocks("d")) == 3
    )
    outputs = scheduler.update_from_output(out, runner_output(scheduler, out, EOS))
    assert outputs[0].finish_reason == FinishReason.STOP
    scheduler.schedule()


def test_abort_while_receiving_holds_blocks_until_the_transfer_ends(
    make_scheduler: MakeScheduler,
) -> None:
    scheduler = make_scheduler(block_size=16, kv_connector=FakeConnector())
    scheduler.add_request(remote_prefill_request("d", 20))
    out = scheduler.schedule()
    scheduler.finish_requests("d", RequestStatus.FINISHED_ABORTED)
    # The worker may still be writing into the blocks: they stay allocated.
    assert "d" in scheduler.requests and scheduler.kv_cache_manager.get_block_ids("d")
    assert not scheduler.has_unfinished_requests()
    scheduler.update_from_output(out, kv_output(finished_recving={"d"}))
    assert "d" not in scheduler.requests
    scheduler.schedule()


def test_prefill_side_delays_freeing_until_sent(make_scheduler: MakeScheduler) -> None:
    scheduler = make_scheduler(block_size=16, kv_connector=FakeConnector())
    request = make_request("p", prompt=40, max_tokens=1)
    request.kv_transfer_params = {"do_remote_decode": True}
    scheduler.add_request(request)
    out, outputs = step(scheduler)
    (output,) = outputs
    assert output.finish_reason == FinishReason.LENGTH
    block_ids = scheduler.kv_cache_manager.get_block_ids("p")
    assert output.kv_transfer_params == {"do_remote_prefill": True, "remote_block_ids": block_ids}
    assert "p" in scheduler.requests and not scheduler.running and len(block_ids) == 3
    assert all(b.ref_cnt == 1 for b in scheduler.kv_cache_manager.get_blocks("p"))
    out = scheduler.schedule()
    assert out.finished_req_ids == {"p"} and out.total_num_scheduled_tokens == 0
    scheduler.finish_requests("p", RequestStatus.FINISHED_ABORTED)  # already finished: ignored
    scheduler.update_from_output(out, EMPTY_MODEL_RUNNER_OUTPUT)
    assert "p" in scheduler.requests
    scheduler.update_from_output(
        scheduler.schedule(), kv_output(finished_sending={"p"}, finished_recving={"unknown"})
    )
    assert "p" not in scheduler.requests


def test_unexpected_transfer_ids_are_ignored(make_scheduler: MakeScheduler) -> None:
    scheduler = make_scheduler(kv_connector=FakeConnector())
    scheduler.add_request(make_request("r", max_tokens=2))
    out = scheduler.schedule()
    # A running request is neither receiving nor sending: a confused report changes nothing.
    mro = runner_output(scheduler, out)
    mro.kv_connector_output = KVConnectorOutput(
        finished_sending={"r", "gone"}, finished_recving={"r"}
    )
    scheduler.update_from_output(out, mro)
    assert scheduler.requests["r"].status == RequestStatus.RUNNING
    assert (
        scheduler.kv_cache_manager.get_block_ids("r") and not scheduler.finished_recving_kv_req_ids
    )
    step(scheduler)
    scheduler.schedule()
