"""First-token shipping: the decode side continues from the token the prefill instance sampled.

The prefill instance's hop ends with one sampled token; its `kv_transfer_params` carry it as
`first_token_id`. A decode request that gets it streams that token at once (its client's first
token waits for no transfer and no step), and schedules its KV load with the token appended, so
its first step computes that token's KV and samples the second: the prompt's last token is not
computed again. Where the token would end the request, or where what the client asked for needs
the decode side's own sample (n > 1 sequences, logprobs), the request takes the unshipped path:
it recomputes the prompt's last token and samples position 0 itself.
"""

from __future__ import annotations

from typing import Any

from pdserve.sampling_params import SamplingParams


def shipped_first_token(
    kv_transfer_params: dict[str, Any] | None,
    params: SamplingParams,
    stop_token_ids: list[int],
    num_prompt_tokens: int,
    max_model_len: int,
) -> int | None:
    """The token a decode request continues from, or None to sample it here.

    `stop_token_ids`: the EOS ids (ignored or not) and the request's stop_token_ids. Such a
    token either ends the request (the prefill instance then hands nothing over) or was one
    that min_tokens forbids here but not on the prefill hop (the proxy drops min_tokens there):
    either way the decode side samples for itself. Any other token is what this instance would
    have sampled too: greedy takes the same argmax, and seeded noise depends on (seed, position)
    alone."""
    kv = kv_transfer_params or {}
    token = kv.get("first_token_id")
    if not kv.get("do_remote_prefill") or not isinstance(token, int) or token in stop_token_ids:
        return None
    if params.n != 1 or params.logprobs is not None:
        return None
    if (params.max_tokens is not None and params.max_tokens <= 1) or (
        num_prompt_tokens + 1 >= max_model_len
    ):
        return None
    return token
