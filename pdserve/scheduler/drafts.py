"""Speculative decoding's scheduler side: the drafts a decode step verifies (the n-gram's, or
the draft model's the runner proposed), and the rollback of those the model rejected.

A decoding request's draft is the tokens that followed the latest earlier occurrence of the
longest suffix of its tokens (prompt_lookup_max down to prompt_lookup_min tokens; vLLM's n-gram
method). The step schedules the request's next token and its drafts together (1 + k tokens,
their KV slots allocated like any other); the runner verifies them (runners/rejection_sampler.py)
and returns the accepted drafts and one more token; the drafts after the first rejected one are
rolled back here (`num_computed_tokens`: their KV is simply written over later).

A request whose drafts are all rejected pauses drafting for up to 1, 2, 4 .. 64 steps
(consecutive misses double the pause; pauses end on a clock shared by all requests) and then
probes with one draft; an accepted draft ends the pausing. Where nothing repeats, speculation
then costs next to nothing.

Drafts go to decoding requests, greedy or sampled, with penalties, logprobs, min_tokens and
grammars: the runner samples each draft position as a step of one token would. A request under
a grammar takes only the drafts its grammar accepts (the bitmask of each draft position
assumes the drafts before it).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pdserve.config.speculative import SpeculativeConfig
from pdserve.outputs import ModelRunnerOutput
from pdserve.request import Request
from pdserve.scheduler.output import DRAFT_PLACEHOLDER
from pdserve.scheduler.stats import SpecDecodingStats


def propose_ngram(tokens: Sequence[int] | np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest suffix of
    `tokens` between min_n and max_n tokens long; [] where no suffix occurred before."""
    tokens = np.asarray(tokens)
    length = len(tokens)
    if length < 2:
        return []
    # The ends of the earlier occurrences of the 1-token suffix, then of the n-token one, as
    # long as any is left: each pass keeps those whose token n back matches too.
    ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])
    n = 1
    while n < min(max_n, length - 1):
        longer = ends[ends >= n]
        longer = longer[tokens[longer - n] == tokens[length - 1 - n]]
        if not longer.size:
            break
        ends, n = longer, n + 1
    if n < min_n or not ends.size:
        return []
    start = int(ends[-1]) + 1
    return tokens[start : start + k].tolist()


# A request whose drafts keep missing pauses drafting: up to 1, 2, 4 .. this many steps after
# each consecutive miss. Verifying k rejected drafts costs a step about 10-15% on CPU (the
# target's logits and the sampler over k + 1 rows), which text with nothing to copy pays every
# step.
MAX_DRAFT_PAUSE = 64


class Drafter:
    """A step's drafts for a request about to decode its next token: the n-gram's, or those
    the runner proposed after the request's last step (a draft model: runners/draft_model.py,
    `Request.spec_token_ids`)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.config = config
        # A draft model writes its guesses' KV ahead of the tokens it is given: k slots.
        self.num_lookahead_tokens = 0 if config.method == "ngram" else self.k
        # The steps scheduled so far: the clock that pauses after misses end on.
        self.step = 0
        # This step's requests whose next step is paused too, for a model drafter
        # (SchedulerOutput.draft_paused_req_ids).
        self.paused_req_ids: set[str] = set()

    def propose(self, request: Request, room: int, num_tokens: int) -> list[int]:
        """At most `room` drafts (the step's budget), and no more than max_tokens and
        max_model_len leave room for after the next token; `num_tokens`: the request's
        tokens, those its steps in flight may sample counted. With a step in flight, slots
        for the runner to fill (DRAFT_PLACEHOLDER): only it knows that step's tokens."""
        proposed, request.spec_token_ids = request.spec_token_ids, []  # each used once
        if request.draft_resume_step > self.step:
            if request.draft_resume_step > self.step + 1 and self.num_lookahead_tokens:
                self.paused_req_ids.add(request.request_id)
            return []
        # After a miss, a pause ends on one draft: a probe costs a step one row, not k.
        k = 1 if request.draft_misses else self.k
        k = min(k, room, request.max_num_tokens - num_tokens - 1)
        if k <= 0 or not _takes_drafts(request):
            return []
        if request.num_output_placeholders:
            return [DRAFT_PLACEHOLDER] * k
        if self.config.method == "ngram":
            low, high = self.config.prompt_lookup_min, self.config.prompt_lookup_max
            assert low is not None and high is not None
            drafts = propose_ngram(request.all_token_ids, low, high, k)
        else:
            drafts = proposed[:k]
        if drafts and request.structured_output is not None:
            return request.structured_output.valid_prefix(drafts)
        return drafts

    def end_step(self) -> set[str] | None:
        """The step is scheduled: the clock moves on. Returns the requests paused next step."""
        self.step += 1
        paused, self.paused_req_ids = self.paused_req_ids, set()
        return paused or None

    def back_off(self, request: Request, num_accepted: int) -> None:
        """After a verified step: a miss (nothing accepted) doubles the pause before the
        request's next drafts; a hit ends the pausing. A pause of p steps ends on the clock's
        next multiple of p, so that requests paused alike probe in the same step: a step then
        verifies several probes or none (a verifying step costs the whole batch the rejection
        sampler's path)."""
        if num_accepted:
            request.draft_misses = 0
            return
        pause = min(1 << request.draft_misses, MAX_DRAFT_PAUSE)
        request.draft_resume_step = (self.step // pause + 1) * pause
        # Counted only as far as the longest pause: a long run of misses keeps a small shift.
        request.draft_misses = min(request.draft_misses + 1, MAX_DRAFT_PAUSE.bit_length() - 1)


def _takes_drafts(request: Request) -> bool:
    return (
        request.sampling_params.prompt_logprobs is None
        # Decoding: a prompt's last chunk of one token is no place for drafts.
        and request.num_tokens > request.num_prompt_tokens
    )


def keep_proposals(model_runner_output: ModelRunnerOutput, requests: dict[str, Request]) -> None:
    """The runner's drafts for each request's next step (a draft model's)."""
    for req_id, drafts in (model_runner_output.draft_token_ids or {}).items():
        request = requests.get(req_id)
        if request is not None:
            request.spec_token_ids = drafts


def roll_back_rejected(
    spec_token_ids: dict[str, list[int]],
    model_runner_output: ModelRunnerOutput,
    requests: dict[str, Request],
    drafter: Drafter,
    stats: SpecDecodingStats,
) -> None:
    """The drafts the runner rejected no longer count as computed: a request's step returns
    its accepted drafts and one token more. Of placeholder slots, only those the runner
    filled count as drafts."""
    index = model_runner_output.req_id_to_index
    filled = model_runner_output.num_filled_drafts or {}
    for req_id, drafts in spec_token_ids.items():
        request, row = requests.get(req_id), index.get(req_id)
        if request is None or request.is_finished() or request.num_async_tokens_to_discard:
            continue  # the step's tokens are dropped (preempted since: its count restarted)
        request.num_draft_tokens -= len(drafts)
        if row is None:
            continue
        num_accepted = len(model_runner_output.sampled_token_ids[row]) - 1
        request.num_computed_tokens -= len(drafts) - num_accepted
        num_drafts = filled.get(req_id, len(drafts))
        if num_drafts:
            stats.observe(num_drafts, num_accepted)
        drafter.back_off(request, num_accepted)
