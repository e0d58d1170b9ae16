"""What the scheduler reports with every batch of outputs (feeds /metrics)."""

from __future__ import annotations

import msgspec


class PromptTokenSources(msgspec.Struct, array_like=True):
    """Prompt tokens of admitted requests by where their KV came from, counted once per request
    at its first admission (vLLM's prompt_tokens_by_source); the three add up to the prompts."""

    local_compute: int = 0  # computed by this instance
    local_cache_hit: int = 0  # found in its prefix cache
    external_kv_transfer: int = 0  # loaded from a peer (a prefill instance)


class SpecDecodingStats(msgspec.Struct, array_like=True):
    """vLLM's spec-decode counters, cumulative: drafts verified, their tokens, the tokens
    accepted, and accepted per draft position (scheduler/drafts.py)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = msgspec.field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        per_position = self.accepted_per_position
        per_position += [0] * (num_draft_tokens - len(per_position))
        for position in range(num_accepted):
            per_position[position] += 1


class SchedulerStats(msgspec.Struct, array_like=True):
    num_running_reqs: int
    num_waiting_reqs: int
    kv_cache_usage: float
    num_preemptions: int  # cumulative
    prefix_cache_queries: int  # cumulative, in tokens
    prefix_cache_hits: int  # cumulative, in tokens
    # Free blocks == num_blocks - 1 (the null block) means nothing is held: tests assert it.
    num_free_blocks: int
    num_blocks: int
    prompt_tokens_by_source: PromptTokenSources = msgspec.field(default_factory=PromptTokenSources)
    spec_decoding: SpecDecodingStats | None = None  # with speculative decoding
