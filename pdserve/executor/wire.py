"""Wire forms of the two messages of every step: `SchedulerOutput` out, `ModelRunnerOutput` back.

What the reader can derive stays off the wire (a runner output's `req_id_to_index`, a
scheduler output's total token count, the ids of `num_scheduled_tokens` when they are the
requests' own, the prompt part of runner V2's `prefill_token_ids`), and token ids travel as
packed int32 in native byte order. The Python-side types stay as the scheduler and the runners
know them: `to_wire` and `from_wire` convert at the process boundary (see rpc.py).
"""

from __future__ import annotations

import struct
from itertools import accumulate, chain
from typing import Any

import msgspec

from pdserve.outputs import KVConnectorOutput, LogprobsLists, ModelRunnerOutput
from pdserve.sampling_params import SamplingParams
from pdserve.scheduler.output import (
    CachedRequestData,
    GrammarBitmask,
    NewRequestData,
    SchedulerOutput,
)


def pack_int32(values: Any) -> bytes:
    """A sized iterable of ints as int32 (struct.pack is the fastest way from a list)."""
    return struct.pack(f"{len(values)}i", *values)


def unpack_int32(data: bytes) -> list[int]:
    return memoryview(data).cast("i").tolist()


def pack_rows(rows: list[list[int]]) -> tuple[bytes, bytes | None]:
    """Token rows as (every row's tokens in turn, int32 row lengths or None for one per row)."""
    flat = list(chain.from_iterable(rows))
    if len(flat) == len(rows) and [] not in rows:  # then no row has two: one token each
        return pack_int32(flat), None
    return pack_int32(flat), pack_int32(list(map(len, rows)))


def unpack_rows(tokens: bytes, lengths: bytes | None) -> list[list[int]]:
    flat = unpack_int32(tokens)
    if lengths is None:
        return [[t] for t in flat]
    counts = unpack_int32(lengths)
    return [flat[end - n : end] for end, n in zip(accumulate(counts), counts)]


# ---- ModelRunnerOutput -----------------------------------------------------------------------


class ModelRunnerOutputWire(msgspec.Struct, array_like=True, omit_defaults=True):
    """`req_ids` travel as positions in the step's `num_scheduled_tokens` (both None: in that
    order), so the engine reuses its own strings; explicit ids only for a request it did not
    schedule."""

    sampled: bytes
    sampled_lengths: bytes | None = None
    req_positions: bytes | None = None
    req_ids: list[str] | None = None
    logprobs: LogprobsLists | None = None
    kv_connector_output: KVConnectorOutput | None = None
    prompt_logprobs_dict: dict[str, LogprobsLists] | None = None
    draft_token_ids: dict[str, list[int]] | None = None
    num_filled_drafts: dict[str, int] | None = None


def _scheduled_ids(call_args: tuple[Any, ...]) -> list[str] | None:
    so = call_args[0] if call_args else None
    return list(so.num_scheduled_tokens) if isinstance(so, SchedulerOutput) else None


def model_runner_output_to_wire(
    output: ModelRunnerOutput, call_args: tuple[Any, ...]
) -> ModelRunnerOutputWire:
    sampled, lengths = pack_rows(output.sampled_token_ids)
    wire = ModelRunnerOutputWire(
        sampled,
        lengths,
        None,
        None,
        output.logprobs,
        output.kv_connector_output,
        output.prompt_logprobs_dict,
        output.draft_token_ids,
        output.num_filled_drafts,
    )
    scheduled = _scheduled_ids(call_args)
    if scheduled is None:
        wire.req_ids = output.req_ids
    elif output.req_ids != scheduled:
        position = dict(zip(scheduled, range(len(scheduled))))
        try:
            wire.req_positions = pack_int32(list(map(position.__getitem__, output.req_ids)))
        except KeyError:
            wire.req_ids = output.req_ids
    return wire


def model_runner_output_from_wire(
    wire: ModelRunnerOutputWire, call_args: tuple[Any, ...]
) -> ModelRunnerOutput:
    req_ids = wire.req_ids
    if req_ids is None:
        scheduled = _scheduled_ids(call_args)
        assert scheduled is not None, "a runner output answers a SchedulerOutput"
        if wire.req_positions is None:
            req_ids = scheduled
        else:
            req_ids = list(map(scheduled.__getitem__, unpack_int32(wire.req_positions)))
    return ModelRunnerOutput(
        req_ids,
        unpack_rows(wire.sampled, wire.sampled_lengths),
        wire.logprobs,
        wire.kv_connector_output,
        wire.prompt_logprobs_dict,
        wire.draft_token_ids,
        wire.num_filled_drafts,
    )


# ---- SchedulerOutput -------------------------------------------------------------------------


class NewRequestWire(msgspec.Struct, array_like=True, omit_defaults=True):
    req_id: str
    prompt_token_ids: bytes
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    # prefill_token_ids after the prompt (runner V2: the tokens generated before a preemption).
    prefill_tail: bytes | None = None


class SchedulerOutputWire(msgspec.Struct, array_like=True, omit_defaults=True):
    new_reqs: list[NewRequestWire]
    cached_req_ids: list[str]
    resumed_req_ids: set[str]
    all_token_ids: dict[str, bytes]
    new_block_ids: list[list[int] | None]
    num_computed_tokens: list[int]
    num_output_tokens: list[int]
    num_scheduled_tokens: bytes
    # The ids of num_scheduled_tokens, unless they are the cached requests' then the new ones'.
    num_scheduled_req_ids: list[str] | None
    finished_req_ids: set[str]
    preempted_req_ids: set[str] | None = None
    kv_connector_metadata: bytes | None = None
    grammar_bitmask: GrammarBitmask | None = None
    scheduled_spec_decode_tokens: dict[str, list[int]] | None = None
    draft_paused_req_ids: set[str] | None = None


def _new_request_to_wire(new: NewRequestData) -> NewRequestWire:
    prompt = new.prompt_token_ids
    tail = None
    if new.prefill_token_ids is not None:
        assert new.prefill_token_ids[: len(prompt)] == prompt, "prefill must start with the prompt"
        tail = pack_int32(new.prefill_token_ids[len(prompt) :])
    return NewRequestWire(
        new.req_id,
        pack_int32(prompt),
        new.sampling_params,
        new.block_ids,
        new.num_computed_tokens,
        tail,
    )


def _new_request_from_wire(wire: NewRequestWire) -> NewRequestData:
    prompt = unpack_int32(wire.prompt_token_ids)
    prefill = None if wire.prefill_tail is None else prompt + unpack_int32(wire.prefill_tail)
    return NewRequestData(
        wire.req_id,
        prompt,
        wire.sampling_params,
        wire.block_ids,
        wire.num_computed_tokens,
        prefill,
    )


def scheduler_output_to_wire(
    so: SchedulerOutput, call_args: tuple[Any, ...]
) -> SchedulerOutputWire:
    cached = so.scheduled_cached_reqs
    num_scheduled = so.num_scheduled_tokens
    req_ids = list(num_scheduled)
    own_ids = cached.req_ids
    if so.scheduled_new_reqs:
        own_ids = own_ids + [new.req_id for new in so.scheduled_new_reqs]
    return SchedulerOutputWire(
        [_new_request_to_wire(new) for new in so.scheduled_new_reqs],
        cached.req_ids,
        cached.resumed_req_ids,
        {req_id: pack_int32(ids) for req_id, ids in cached.all_token_ids.items()},
        cached.new_block_ids,
        cached.num_computed_tokens,
        cached.num_output_tokens,
        pack_int32(num_scheduled.values()),
        None if req_ids == own_ids else req_ids,
        so.finished_req_ids,
        so.preempted_req_ids,
        so.kv_connector_metadata,
        so.grammar_bitmask,
        so.scheduled_spec_decode_tokens,
        so.draft_paused_req_ids,
    )


def scheduler_output_from_wire(
    wire: SchedulerOutputWire, call_args: tuple[Any, ...]
) -> SchedulerOutput:
    new_reqs = [_new_request_from_wire(new) for new in wire.new_reqs]
    req_ids = wire.num_scheduled_req_ids
    if req_ids is None:
        req_ids = wire.cached_req_ids + [new.req_id for new in new_reqs]
    num_tokens = unpack_int32(wire.num_scheduled_tokens)
    cached = CachedRequestData(
        wire.cached_req_ids,
        wire.resumed_req_ids,
        {req_id: unpack_int32(ids) for req_id, ids in wire.all_token_ids.items()},
        wire.new_block_ids,
        wire.num_computed_tokens,
        wire.num_output_tokens,
    )
    return SchedulerOutput(
        new_reqs,
        cached,
        dict(zip(req_ids, num_tokens)),
        sum(num_tokens),
        wire.finished_req_ids,
        wire.preempted_req_ids,
        wire.kv_connector_metadata,
        wire.grammar_bitmask,
        wire.scheduled_spec_decode_tokens,
        wire.draft_paused_req_ids,
    )


# type -> (its wire type, to_wire, from_wire); both take the arguments of the call the value
# belongs to (a result is encoded relative to them).
CODECS: dict[type, tuple[type, Any, Any]] = {
    ModelRunnerOutput: (
        ModelRunnerOutputWire,
        model_runner_output_to_wire,
        model_runner_output_from_wire,
    ),
    SchedulerOutput: (SchedulerOutputWire, scheduler_output_to_wire, scheduler_output_from_wire),
}
