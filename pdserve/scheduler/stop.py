"""When a sampled token ends its request: EOS, a stop token id, or a length limit."""

from __future__ import annotations

from pdserve.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> bool:
    """Set the finished status of a request whose last token ends it; True if it does."""
    params = request.sampling_params
    num_output_tokens = request.num_output_tokens
    if num_output_tokens >= params.min_tokens:
        last_token_id = request.all_token_ids[-1]
        if last_token_id == request.eos_token_id and not params.ignore_eos:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if params.stop_token_ids and last_token_id in params.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last_token_id
            return True
    # Length limits hold whatever min_tokens asks: no position may pass max_model_len.
    max_tokens = request.max_tokens
    if (max_tokens is not None and num_output_tokens >= max_tokens) or (
        request.num_tokens >= max_model_len
    ):
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False


def append_until_stop(
    request: Request, new_token_ids: list[int], max_model_len: int
) -> tuple[list[int], bool]:
    """Append tokens one by one; those after a stopping token are dropped."""
    for num_new, token_id in enumerate(new_token_ids, 1):
        request.append_output_token_ids(token_id)
        if check_stop(request, max_model_len):
            return new_token_ids[:num_new], True
    return new_token_ids, False
