"""Builders for the prefill/decode lifecycle tests: a Scheduler beside a real NixlConnector
scheduler role, requests that carry kv_transfer_params, and what the workers report
(reference §4.3). The connector role binds no side channel until it is handed the workers'
handshake metadata, so none of these needs a port."""

from __future__ import annotations

from typing import Any

import msgspec

from pdserve.config import EngineConfig
from pdserve.kv_connector.nixl.metadata import NixlConnectorMetadata
from pdserve.kv_connector.nixl.scheduler import NixlConnectorScheduler
from pdserve.kv_transfer_params import KVTransferParams
from pdserve.outputs import KVConnectorOutput, ModelRunnerOutput
from pdserve.request import Request
from pdserve.scheduler.output import SchedulerOutput
from pdserve.scheduler.scheduler import Scheduler
from tests.unit.scheduler.conftest import EOS, make_request
from tests.unit.scheduler.conftest import assert_scheduler_empty as assert_no_requests_or_blocks

BLOCK_SIZE = 16
REMOTE_ENGINE_ID = "my-engine-id"


def create_scheduler(
    model: str,
    num_blocks: int = 10_000,
    block_size: int = BLOCK_SIZE,
    use_v2: bool = False,
    kv_role: str = "kv_consumer",
    policy: str = "fail",
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 16,
    kv_buffer_device: str | None = None,
    **kv_extra: Any,
) -> Scheduler:
    """A scheduler of `num_blocks` blocks (one is the null block) with prefix caching on;
    `policy` is the kv_load_failure_policy, `kv_extra` more kv_connector_extra_config."""
    config = EngineConfig.from_engine_args(
        model=model,
        block_size=block_size,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        kv_transfer_config={
            "kv_connector": "NixlConnector",
            "kv_role": kv_role,
            "kv_connector_extra_config": {"kv_load_failure_policy": policy, **kv_extra},
            "kv_buffer_device": kv_buffer_device,
        },
    )
    connector = NixlConnectorScheduler(config)
    return Scheduler(
        config.scheduler_config,
        config.cache_config,
        config.model_config.max_model_len,
        num_blocks,
        use_v2,
        kv_connector=connector,
    )


def create_request(
    request_id: int,
    num_tokens: int = 10,
    common_prefix_len: int = 0,
    max_tokens: int = 16,
    do_remote_prefill: bool = False,
    do_remote_decode: bool = False,
    num_remote_blocks: int = 3,
) -> Request:
    """Request "id-<n>": `common_prefix_len` tokens shared by every request, then tokens
    unique to it. A remote-decode request (prefill side) generates one token, as the proxy asks."""
    assert not (do_remote_prefill and do_remote_decode)
    unique = [1000 * request_id + i for i in range(num_tokens - common_prefix_len)]
    params = None
    if do_remote_decode:
        max_tokens = 1
        params = KVTransferParams(do_remote_decode=True)
    elif do_remote_prefill:
        params = KVTransferParams(
            do_remote_prefill=True,
            remote_engine_id=REMOTE_ENGINE_ID,
            remote_request_id=f"prefill-{request_id}",
            remote_block_ids=list(range(num_remote_blocks)),
            remote_host="my-host",
            remote_port=1234,
            tp_size=1,
        )
    request = make_request(
        f"id-{request_id}", prompt=[1] * common_prefix_len + unique, max_tokens=max_tokens
    )
    request.kv_transfer_params = params
    return request


def create_model_runner_output(
    reqs: list[Request],
    finished_sending: set[str] | None = None,
    finished_recving: set[str] | None = None,
    invalid_block_ids: set[int] | None = None,
    load_errors: dict[str, str] | None = None,
    use_eos: bool = False,
    token_id: int = 0,
) -> ModelRunnerOutput:
    """One sampled token per request (EOS if `use_eos`), and the workers' transfer news."""
    req_ids = [r.request_id for r in reqs]
    kv_output = None
    if finished_sending or finished_recving or invalid_block_ids:
        kv_output = KVConnectorOutput(
            finished_sending=finished_sending,
            finished_recving=finished_recving,
            invalid_block_ids=invalid_block_ids or set(),
            load_errors=load_errors,
        )
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
        sampled_token_ids=[[EOS if use_eos else token_id] for _ in req_ids],
        kv_connector_output=kv_output,
    )


def connector_meta(scheduler_output: SchedulerOutput) -> NixlConnectorMetadata:
    """The step's orders for the workers, decoded as a worker does."""
    assert scheduler_output.kv_connector_metadata is not None
    return msgspec.msgpack.decode(
        scheduler_output.kv_connector_metadata, type=NixlConnectorMetadata
    )


def step(scheduler: Scheduler, reqs: list[Request], **kv_news: Any) -> SchedulerOutput:
    """Schedule, then report one token for each of `reqs` and the given transfer news."""
    out = scheduler.schedule()
    scheduler.update_from_output(out, create_model_runner_output(reqs, **kv_news))
    return out


def num_waiting(scheduler: Scheduler) -> int:
    return len(scheduler.waiting) + len(scheduler.remote_kv.skipped_waiting)


def num_running_waiting(scheduler: Scheduler) -> tuple[int, int]:
    return len(scheduler.running), num_waiting(scheduler)


def assert_scheduler_empty(scheduler: Scheduler) -> None:
    """No request anywhere, every usable block free with no reference, and no transfer the
    connector still waits for (invariant 2; cached hashes may stay: eviction is lazy)."""
    assert_no_requests_or_blocks(scheduler)
    assert not scheduler.finished_req_ids
    assert not scheduler.connector.has_pending_transfers()
