"""Outputs of the model runner (worker -> engine) and of the engine (engine -> user)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec


class LogprobsLists(msgspec.Struct, array_like=True):
    """Top-k log-probabilities per sampled token, row i for `req_ids[i]` of the step.

    Column 0 is the sampled token; columns 1.. are the k most likely tokens.
    """

    logprob_token_ids: list[list[int]]
    logprobs: list[list[float]]
    sampled_token_ranks: list[int]


class KVConnectorOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    finished_sending: set[str] | None = None
    finished_recving: set[str] | None = None
    invalid_block_ids: set[int] = msgspec.field(default_factory=set)
    # Counters since the last step (bytes, transfers, failures...), summed over workers.
    stats: dict[str, float] | None = None

    def is_empty(self) -> bool:
        return not (
            self.finished_sending or self.finished_recving or self.invalid_block_ids or self.stats
        )


class ModelRunnerOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    req_ids: list[str]
    req_id_to_index: dict[str, int]
    # One list per request: empty for a request in the middle of a chunked prefill.
    sampled_token_ids: list[list[int]]
    logprobs: LogprobsLists | None = None
    kv_connector_output: KVConnectorOutput | None = None


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[])


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """New tokens of one request after one engine step."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: LogprobsLists | None = None
    finish_reason: int | None = None  # a FinishReason value
    stop_reason: int | str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    num_cached_tokens: int = 0


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    kv_transfer_params: dict[str, Any] | None = None
    metrics: dict[str, float] = field(default_factory=dict)
