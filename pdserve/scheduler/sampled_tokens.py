"""A step's sampled tokens applied to their requests: append, stop check, the blocks the
tokens complete, and one EngineCoreOutput each.

Async scheduling: each token replaces a placeholder. Tokens of requests that finished while
the step was in flight, and of requests preempted since, are dropped.
"""

from __future__ import annotations

from collections.abc import Iterable

from pdserve.outputs import EngineCoreOutput, LogprobsLists, ModelRunnerOutput
from pdserve.request import Request, RequestStatus
from pdserve.scheduler.kv_cache_manager import KVCacheManager
from pdserve.scheduler.stop import append_until_stop, check_stop


def sampled_rows(
    step_in_flight: tuple[list[Request], list[str]] | None,
    num_scheduled_tokens: dict[str, int],
    model_runner_output: ModelRunnerOutput,
    requests: dict[str, Request],
) -> Iterable[tuple[Request, list[int]]]:
    """(request, its sampled tokens) for each request the step scheduled that the runner ran,
    in the scheduler's order; `step_in_flight` is the step's requests and ids if known."""
    sampled_token_ids = model_runner_output.sampled_token_ids
    if step_in_flight is not None and model_runner_output.req_ids == step_in_flight[1]:
        # The runner kept the scheduler's order (runner V2 on decode steps): no lookups.
        return zip(step_in_flight[0], sampled_token_ids)
    index = model_runner_output.req_id_to_index
    return [
        (request, sampled_token_ids[i])
        for req_id in num_scheduled_tokens
        if (i := index.get(req_id)) is not None
        # None: finished while the step ran, and its blocks freed.
        and (request := requests.get(req_id)) is not None
    ]


def apply_sampled_tokens(
    rows: Iterable[tuple[Request, list[int]]],
    kv_cache_manager: KVCacheManager,
    max_model_len: int,
) -> tuple[list[EngineCoreOutput], list[tuple[Request, EngineCoreOutput]]]:
    """Apply each (request, its sampled tokens) row.

    Returns the outputs, in row order, and the requests their tokens ended with their outputs
    (finish and stop reasons set; freeing them, and their kv_transfer_params, is the caller's).
    """
    running_status = RequestStatus.RUNNING
    outputs: list[EngineCoreOutput] = []
    append_output = outputs.append
    stopped: list[tuple[Request, EngineCoreOutput]] = []
    for request, new_token_ids in rows:
        if not new_token_ids:
            continue  # in the middle of a chunked prefill
        if (
            request.status is not running_status or request.num_async_tokens_to_discard
        ) and _drop_stale_token(request):
            continue
        num_placeholders = request.num_output_placeholders - 1
        request.num_output_placeholders = num_placeholders
        try:
            (token_id,) = new_token_ids  # the norm: one token per request and step
        except ValueError:
            new_token_ids, ended = append_until_stop(request, new_token_ids, max_model_len)
        else:
            # Request.append_output_token_ids, inlined: this runs for every request and step.
            request.all_token_ids.append(token_id)
            num_tokens = request.num_tokens = request.num_tokens + 1
            # Most tokens end nothing: check_stop runs only when one may (max_num_tokens is
            # capped at max_model_len).
            if token_id in request.stop_token_candidates or num_tokens >= request.max_num_tokens:
                ended = check_stop(request, max_model_len)
            else:
                ended = False
        if request.structured_output is not None:
            request.structured_output.accept(request.request_id, new_token_ids)
        if num_placeholders != 0:  # other steps in flight (or a token nobody expected)
            assert num_placeholders > 0, "a token the scheduler did not expect"
            # Blocks of tokens known only now: schedule() cached every known token, so only a
            # step that had others in flight can have left some; those the steps still in
            # flight sample wait. Without prefix caching the boundary is never reached.
            num_known_computed = (
                request.num_computed_tokens - num_placeholders - request.num_draft_tokens
            )
            if num_known_computed >= request.next_kv_boundary:
                kv_cache_manager.cache_blocks(request, num_known_computed)
        if ended:
            output = EngineCoreOutput(
                request.request_id,
                new_token_ids,
                None,
                int(request.get_finished_reason()),  # type: ignore[arg-type]
                request.stop_reason,
                None,
                request.num_cached_tokens,
                kv_load_recomputed=request.kv_load_recomputed,
            )
            stopped.append((request, output))
            append_output(output)
        else:
            append_output(
                EngineCoreOutput(
                    request.request_id,
                    new_token_ids,
                    None,
                    None,
                    None,
                    None,
                    request.num_cached_tokens,
                )
            )
    return outputs, stopped


def _drop_stale_token(request: Request) -> bool:
    """Whether a sampled token is one to drop: its request finished while the step ran, or
    was preempted (it resumes without the token)."""
    if request.status > RequestStatus.PREEMPTED:  # finished
        return True
    if request.num_async_tokens_to_discard:
        request.num_async_tokens_to_discard -= 1
        return True
    return False


def attach_logprobs(
    outputs: list[EngineCoreOutput], model_runner_output: ModelRunnerOutput
) -> None:
    """Each output's rows: row i belongs to the runner's request i, or request i's rows start
    at cu[i] (several tokens a step), as many as its tokens a stop left."""
    logprobs = model_runner_output.logprobs
    assert logprobs is not None
    index = model_runner_output.req_id_to_index
    cu = logprobs.cu_num_generated_tokens
    for output in outputs:
        row = index[output.request_id]
        start, end = (
            (row, row + 1) if cu is None else (cu[row], cu[row] + len(output.new_token_ids))
        )
        output.new_logprobs = LogprobsLists(
            logprobs.logprob_token_ids[start:end],
            logprobs.logprobs[start:end],
            logprobs.sampled_token_ranks[start:end],
        )


def attach_prompt_logprobs(
    outputs: list[EngineCoreOutput], prompt_logprobs_dict: dict[str, LogprobsLists]
) -> None:
    """Each with its request's first token (a token dropped as stale drops them too: the
    runner computes them again when the request's prompt is)."""
    for output in outputs:
        prompt_logprobs = prompt_logprobs_dict.get(output.request_id)
        if prompt_logprobs is not None:
            output.prompt_logprobs = prompt_logprobs
