"""Messages between the front end (LLM / AsyncLLM) and the EngineCore process.

Front end -> engine: one ZMQ multipart message [type, payload]; engine -> front end:
`EngineCoreOutputs`. Payloads are msgpack-encoded msgspec Structs.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from pdserve.kv_transfer_params import KVTransferParams
from pdserve.outputs import EngineCoreOutput
from pdserve.request import Request
from pdserve.sampling_params import SamplingParams
from pdserve.scheduler.scheduler import SchedulerStats


class EngineCoreRequestType(bytes, enum.Enum):
    ADD = b"\x00"
    ABORT = b"\x01"
    UTILITY = b"\x02"


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float
    kv_transfer_params: KVTransferParams | None = None
    priority: int = 0
    # Generated elsewhere (the token a prefill instance sampled): the request continues after
    # them, and their outputs are not sent again.
    output_token_ids: list[int] = []
    cache_salt: str | None = None

    def to_request(self) -> Request:
        request = Request(
            self.request_id,
            self.prompt_token_ids,
            self.sampling_params,
            self.eos_token_id,
            arrival_time=self.arrival_time,
            priority=self.priority,
            kv_transfer_params=self.kv_transfer_params,
            cache_salt=self.cache_salt,
        )
        if self.output_token_ids:
            request.append_output_token_ids(self.output_token_ids)
        return request


class UtilityCall(msgspec.Struct, array_like=True):
    call_id: int
    method: str
    args: list[Any]


class UtilityResult(msgspec.Struct, array_like=True, omit_defaults=True):
    call_id: int
    result: Any = None
    error: str | None = None


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    timestamp: float
    outputs: list[EngineCoreOutput] = msgspec.field(default_factory=list)
    scheduler_stats: SchedulerStats | None = None
    kv_connector_stats: dict[str, float] | None = None  # cumulative
    utility_result: UtilityResult | None = None
    # Requests the engine refused (request id -> why); they end with an error at the client.
    rejected: dict[str, str] | None = None
    # Set on the last message of an engine that hit a fatal error and is exiting.
    engine_error: str | None = None
