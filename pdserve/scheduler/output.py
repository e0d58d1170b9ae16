"""What the scheduler hands to the workers each step (it crosses a process boundary)."""

from __future__ import annotations

from typing import Any

import msgspec

from pdserve.sampling_params import SamplingParams


class NewRequestData(msgspec.Struct, array_like=True, omit_defaults=True):
    """A request the worker sees for the first time (or, under runner V2, again after preemption).

    `block_ids` is the request's whole block table (one KV cache group). `num_computed_tokens`
    is taken before the scheduler advances it for this step: the prefix-cache hit length.
    `prefill_token_ids`: prompt + tokens generated so far, always for runner V2; for runner V1
    only when a new request continues from a token another instance sampled.
    """

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    prefill_token_ids: list[int] | None = None

    @classmethod
    def from_request(
        cls, request: Any, block_ids: list[int], prefill_token_ids: list[int] | None = None
    ) -> NewRequestData:
        return cls(
            req_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling_params=request.sampling_params,
            block_ids=block_ids,
            num_computed_tokens=request.num_computed_tokens,
            prefill_token_ids=prefill_token_ids,
        )


class CachedRequestData(msgspec.Struct, array_like=True):
    """Requests the worker already holds, as a struct of lists.

    For ids in `resumed_req_ids` (runner V1 only) `new_block_ids` replaces the worker's block
    table; otherwise new ids are appended. `all_token_ids` carries the full token list of
    requests that were not scheduled in the previous step (runner V1 only). There is no
    vLLM-style `new_token_ids`: under pipeline parallelism every stage gets the step's sampled
    tokens from the last one within the step (runners/base.py), not from the scheduler.
    """

    req_ids: list[str]
    resumed_req_ids: set[str]
    all_token_ids: dict[str, list[int]]
    new_block_ids: list[list[int] | None]
    num_computed_tokens: list[int]
    num_output_tokens: list[int]

    @classmethod
    def make_empty(cls) -> CachedRequestData:
        return cls([], set(), {}, [], [], [])


class GrammarBitmask(msgspec.Struct, array_like=True):
    """Structured outputs: the tokens each of these requests may sample this step, one row
    of ceil(vocab_size / 32) int32 words each (bit t % 32 of word t // 32 allows token t), as
    xgrammar fills them."""

    req_ids: list[str]
    bitmask: bytes


DRAFT_PLACEHOLDER = -1


class SchedulerOutput(msgspec.Struct, array_like=True):
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]
    # Only used by runner V2, which drops the state row of each of these requests.
    preempted_req_ids: set[str] | None = None
    # The connector's metadata, encoded by the scheduler and decoded by the worker connector.
    kv_connector_metadata: bytes | None = None
    grammar_bitmask: GrammarBitmask | None = None
    # Speculative decoding: each request's drafts, scheduled after its next token (vLLM's name).
    # A request with a step in flight (async scheduling) gets DRAFT_PLACEHOLDER slots: its
    # runner, which knows that step's tokens, fills them.
    scheduled_spec_decode_tokens: dict[str, list[int]] | None = None
    # Requests whose drafting is paused (scheduler/drafts.py) for their next step too: a
    # model drafter need not guess for them after this one.
    draft_paused_req_ids: set[str] | None = None

    @classmethod
    def make_empty(cls) -> SchedulerOutput:
        return cls([], CachedRequestData.make_empty(), {}, 0, set())
