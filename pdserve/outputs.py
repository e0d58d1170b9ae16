"""Outputs of the model runner (worker -> engine) and of the engine (engine -> user)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import msgspec

from pdserve.kv_transfer_params import KVTransferParams


class LogprobsLists(msgspec.Struct, array_like=True):
    """Top-k log-probabilities per sampled token, row i for `req_ids[i]` of the step.

    Column 0 is the sampled token; columns 1.. are the k most likely tokens. A request's prompt
    logprobs are one such table too: row i for prompt position i + 1, column 0 its prompt token.
    """

    logprob_token_ids: list[list[int]]
    logprobs: list[list[float]]
    sampled_token_ranks: list[int]
    # A step whose requests output several tokens (speculative decoding): request i's rows
    # are [cu[i], cu[i + 1]), one per token; None: row i is request i's one token.
    cu_num_generated_tokens: list[int] | None = None


class KVConnectorOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    finished_sending: set[str] | None = None
    finished_recving: set[str] | None = None
    invalid_block_ids: set[int] = msgspec.field(default_factory=set)
    # Counters since the last step (bytes, transfers, failures...), summed over workers.
    stats: dict[str, float] | None = None
    # Request id -> why its load failed (its blocks are among `invalid_block_ids`).
    load_errors: dict[str, str] | None = None

    def is_empty(self) -> bool:
        return not (
            self.finished_sending
            or self.finished_recving
            or self.invalid_block_ids
            or self.stats
            or self.load_errors
        )


class ModelRunnerOutput:
    """One step of the runner: row i is `req_ids[i]`, in the runner's batch order.

    `sampled_token_ids[i]` lists the tokens request i sampled: empty in the middle of a chunked
    prefill. `prompt_logprobs_dict` holds the prompt logprobs of the requests that asked for
    them and sampled their first token in this step (None: no such request). Not a msgspec
    Struct: its wire form (executor/wire.py) packs the tokens and leaves out
    `req_id_to_index`, which is derived from `req_ids` when first read.
    """

    __slots__ = (
        "req_ids",
        "sampled_token_ids",
        "logprobs",
        "kv_connector_output",
        "prompt_logprobs_dict",
        "draft_token_ids",
        "num_filled_drafts",
        "_index",
    )

    def __init__(
        self,
        req_ids: list[str],
        sampled_token_ids: list[list[int]],
        logprobs: LogprobsLists | None = None,
        kv_connector_output: KVConnectorOutput | None = None,
        prompt_logprobs_dict: dict[str, LogprobsLists] | None = None,
        draft_token_ids: dict[str, list[int]] | None = None,
        num_filled_drafts: dict[str, int] | None = None,
        *,
        req_id_to_index: dict[str, int] | None = None,  # when the caller has it already
    ) -> None:
        self.req_ids = req_ids
        self.sampled_token_ids = sampled_token_ids
        self.logprobs = logprobs
        self.kv_connector_output = kv_connector_output
        self.prompt_logprobs_dict = prompt_logprobs_dict
        # A draft model's guesses for each request's next step (speculative decoding).
        self.draft_token_ids = draft_token_ids
        # Async scheduling: how many of the draft slots scheduled as placeholders the runner
        # filled with guesses, per request (the rest it left out of the verification).
        self.num_filled_drafts = num_filled_drafts
        self._index = req_id_to_index

    def with_kv_connector_output(self, kv: KVConnectorOutput) -> ModelRunnerOutput:
        """A copy with the workers' connector report: a step with nothing scheduled returns the
        shared empty output, which must never be mutated."""
        return ModelRunnerOutput(
            self.req_ids,
            self.sampled_token_ids,
            self.logprobs,
            kv,
            self.prompt_logprobs_dict,
            self.draft_token_ids,
            self.num_filled_drafts,
            req_id_to_index=self._index,
        )

    @property
    def req_id_to_index(self) -> dict[str, int]:
        if self._index is None:
            self._index = dict(zip(self.req_ids, range(len(self.req_ids))))
        return self._index

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ModelRunnerOutput):
            return NotImplemented
        return (
            self.req_ids == other.req_ids
            and self.sampled_token_ids == other.sampled_token_ids
            and self.logprobs == other.logprobs
            and self.kv_connector_output == other.kv_connector_output
            and self.prompt_logprobs_dict == other.prompt_logprobs_dict
            and self.draft_token_ids == other.draft_token_ids
            and self.num_filled_drafts == other.num_filled_drafts
        )

    def __repr__(self) -> str:
        return (
            f"ModelRunnerOutput(req_ids={self.req_ids!r}, "
            f"sampled_token_ids={self.sampled_token_ids!r}, logprobs={self.logprobs!r}, "
            f"kv_connector_output={self.kv_connector_output!r}, "
            f"prompt_logprobs_dict={self.prompt_logprobs_dict!r})"
        )


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput(req_ids=[], sampled_token_ids=[])


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """New tokens of one request after one engine step."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: LogprobsLists | None = None
    finish_reason: int | None = None  # a FinishReason value
    stop_reason: int | str | None = None
    kv_transfer_params: KVTransferParams | None = None
    num_cached_tokens: int = 0
    # With finish_reason ERROR: why the request failed, for its client.
    error: str | None = None
    # With the request's first token, if it asked for them (LogprobsLists' prompt form).
    prompt_logprobs: LogprobsLists | None = None
    # With its last output: its KV load failed and the rest was recomputed here.
    kv_load_recomputed: bool = False


class RequestOutputKind(enum.IntEnum):
    """What a request's outputs hold (vLLM's names)."""

    CUMULATIVE = 0  # after every step, everything so far
    DELTA = 1  # after every step, only what is new (the last one carries the finish reason)
    FINAL_ONLY = 2  # once, when the request finishes


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
    error: str | None = None  # with finish_reason "error": why

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    # With SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (a
    # DELTA stream has them in its first output only).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0
    kv_transfer_params: KVTransferParams | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    kv_load_recomputed: bool = False  # see EngineCoreOutput
