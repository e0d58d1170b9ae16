"""The scheduler's view of one request."""

from __future__ import annotations

import enum
import sys
import time
from typing import TYPE_CHECKING

from pdserve.kv_transfer_params import KVTransferParams
from pdserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pdserve.structured_output.manager import StructuredOutputRequest


class FinishReason(enum.IntEnum):
    """Why the engine ended a request, as its last output says. An aborted request has none: the
    engine sends it no output, its front end reports the abort."""

    STOP = 0
    LENGTH = 1
    ERROR = 2

    def __str__(self) -> str:
        return self.name.lower()


class RequestStatus(enum.IntEnum):
    """Ordered so that `status > PREEMPTED` means finished."""

    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: RequestStatus) -> FinishReason | None:
        return _FINISHED_REASONS.get(status)


_FINISHED_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
        arrival_time: float | None = None,
        priority: int = 0,
        kv_transfer_params: KVTransferParams | None = None,
        cache_salt: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.priority = priority
        self.kv_transfer_params = kv_transfer_params
        # Only requests with the same salt (or none) share prefix-cache blocks: it enters the
        # hash of the first block (scheduler/kv_cache_utils.py).
        self.cache_salt = cache_salt

        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_computed_tokens = 0
        # Async scheduling: tokens that steps in flight will sample, counted in the next
        # schedule() before they are known (update_from_output turns each into a real token).
        self.num_output_placeholders = 0
        # Tokens that steps in flight at a preemption will still sample: the request resumes
        # from the tokens known then, so these are dropped when they arrive.
        self.num_async_tokens_to_discard = 0
        # Speculative decoding: the drafts its step in flight verifies (scheduler/drafts.py).
        self.num_draft_tokens = 0
        # A draft model's guesses for its next step, from the runner (scheduler/drafts.py).
        self.spec_token_ids: list[int] = []
        # The scheduler's step from which it drafts again, and the drafting steps in a row that
        # missed (scheduler/drafts.py's Drafter.back_off).
        self.draft_resume_step = 0
        self.draft_misses = 0
        # Set at first admission (scheduler/admission.py): prompt tokens a prefix cache served,
        # here or on the instance that computed the KV it loaded (usage's cached_tokens).
        self.num_cached_tokens = -1
        # Its local prefix-cache hits at its first allocation (a parked load is admitted later),
        # and, set by a KV connector, how many of the loaded prompt's leading tokens the peer
        # found in its own prefix cache.
        self.num_local_cached_tokens = 0
        self.num_remote_cached_tokens = 0
        # Its KV load failed and kv_load_failure_policy "recompute" prefilled the rest here:
        # its response says so (X-PD-Path: local; reason=kv-load-failed).
        self.kv_load_recomputed = False
        self.num_preemptions = 0
        self.max_tokens = sampling_params.max_tokens
        # Plain attributes, not properties: the scheduler reads them for every request and
        # step. append_output_token_ids (or the scheduler's inlined copy) keeps num_tokens.
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.num_tokens = self.num_prompt_tokens
        # Filters for the stop check, so that a token that ends nothing costs two comparisons:
        # the tokens that may stop the request (check_stop applies min_tokens and says why),
        # and the length at which it ends (prompt + max_tokens; the scheduler caps it at
        # max_model_len).
        self.stop_token_candidates = frozenset(
            (sampling_params.stop_token_ids or [])
            + ([] if sampling_params.ignore_eos or eos_token_id is None else [eos_token_id])
        )
        self.max_num_tokens = self.num_prompt_tokens + (
            sys.maxsize if self.max_tokens is None else self.max_tokens
        )
        # Chained hashes of the full blocks of `all_token_ids`, filled by the KV cache manager.
        self.block_hashes: list[bytes] = []
        # Owned by the KV cache manager: while computed + scheduled tokens stay below this,
        # the request's blocks have every slot it needs and no block of it is to be cached.
        self.next_kv_boundary = 0
        # Structured outputs: its grammar and matcher (structured_output/manager.py).
        self.structured_output: StructuredOutputRequest | None = None

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        """A copy: the tokens generated so far."""
        return self.all_token_ids[self.num_prompt_tokens :]

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        if isinstance(token_ids, int):
            self.all_token_ids.append(token_ids)
        else:
            self.all_token_ids += token_ids
        self.num_tokens = len(self.all_token_ids)

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> FinishReason | None:
        return RequestStatus.get_finished_reason(self.status)

    def __lt__(self, other: Request) -> bool:
        # Priority queue order: lower priority value first, then earlier arrival.
        return (self.priority, self.arrival_time, self.request_id) < (
            other.priority,
            other.arrival_time,
            other.request_id,
        )
