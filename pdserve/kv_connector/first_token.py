"""First-token shipping: the decode side continues from the token the prefill instance sampled.

The prefill instance's hop ends with one sampled token; its `kv_transfer_params` carry it as
`first_token_id`, and, when the hop asked for logprobs, that token's logprob row as
`first_token_logprobs` (`{"token_ids", "logprobs", "rank"}`: column 0 the sampled token, then
the top ones, as the sampler gives them; the prefill instance's front end adds it, it is the
one that sees the row). A decode request that gets the token streams it at once (its client's
first token waits for no transfer and no step), and schedules its KV load with the token
appended, so its first step computes that token's KV and samples the second: the prompt's last
token is not computed again. Where the token would end the request, or where what the client
asked for needs the decode side's own sample (logprobs the params do not carry), the request
takes the unshipped path: it recomputes the prompt's last token and samples position 0 itself.

With n > 1 only the first sequence continues from the shipped token: it has the hop's seed
(child i gets seed + i, the proxy's hop is sequence 0); the others sample their own
(engine/async_llm.py, which also makes them share the first sequence's transfer).
"""

from __future__ import annotations

from collections.abc import Collection

from pdserve.kv_transfer_params import FirstTokenLogprobs, KVTransferParams
from pdserve.outputs import LogprobsLists


def shipped_first_token(
    kv_transfer_params: KVTransferParams | None,
    *,
    n: int,
    max_tokens: int | None,
    logprobs: int | None,
    stop_token_ids: Collection[int] = (),
    room_after_it: bool = True,
) -> int | None:
    """The token a decode request continues from, or None to sample it there: the one rule,
    which the decode side's front end and the proxy (is the token it streams first the one
    the decode side continues from?) both ask.

    `stop_token_ids`: the EOS ids (ignored or not) and the request's stop_token_ids. Such a
    token either ends the request (the prefill instance then hands nothing over) or was one
    that min_tokens forbids here (a hop sent without min_tokens; pdserve's proxy keeps it as 1):
    either way the decode side samples for itself. The proxy passes none: a prefill answer that
    a stop ended is the client's whole answer. Any other token is what the decode instance would
    have sampled too: greedy takes the same argmax, and seeded noise depends on (seed, position)
    alone. `room_after_it`: the context has room for a token after it."""
    kv = kv_transfer_params
    if kv is None or not kv.do_remote_prefill:
        return None
    token = kv.first_token_id
    if token is None or token in stop_token_ids:
        return None
    if n != 1:  # a parent's params: each of its sequences decides with its own
        return None
    if logprobs is not None and shipped_logprobs(kv, logprobs) is None:
        return None
    if (max_tokens is not None and max_tokens <= 1) or not room_after_it:
        return None
    return token


def first_token_logprobs(row: LogprobsLists) -> FirstTokenLogprobs:
    """Prefill side: the shipped token's row (the step's one row for the request)."""
    return FirstTokenLogprobs(
        list(row.logprob_token_ids[0]), list(row.logprobs[0]), row.sampled_token_ranks[0]
    )


def shipped_logprobs(
    kv_transfer_params: KVTransferParams, num_logprobs: int
) -> LogprobsLists | None:
    """Decode side: the shipped token's row, cut to this request's width (the sampled token and
    `num_logprobs` top ones: a batch's rows are as wide as its widest request's), if the params
    carry one for that token at least that wide; None otherwise."""
    entry = kv_transfer_params.first_token_logprobs
    if not (
        entry is not None
        and len(entry.token_ids) == len(entry.logprobs) > num_logprobs
        and entry.token_ids[0] == kv_transfer_params.first_token_id
    ):
        return None
    width = num_logprobs + 1
    return LogprobsLists([entry.token_ids[:width]], [entry.logprobs[:width]], [entry.rank])
