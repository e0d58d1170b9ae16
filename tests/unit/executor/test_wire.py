"""The step's messages through the RPC layer: what the runner and scheduler see is what was sent,
and what the reader can derive does not travel."""

from __future__ import annotations

import struct

import msgspec
import pytest

from pdserve.executor import rpc, wire
from pdserve.executor.worker import Worker
from pdserve.outputs import (
    EMPTY_MODEL_RUNNER_OUTPUT,
    KVConnectorOutput,
    LogprobsLists,
    ModelRunnerOutput,
)
from pdserve.sampling_params import SamplingParams
from pdserve.scheduler.output import (
    CachedRequestData,
    GrammarBitmask,
    NewRequestData,
    SchedulerOutput,
)


def scheduler_output(num_scheduled_tokens: dict[str, int] | None = None) -> SchedulerOutput:
    new = [
        NewRequestData("new-0", [5, 6, 7], SamplingParams(max_tokens=3), [3], 0),
        # Runner V2, resumed after preemption: prompt + the tokens generated before.
        NewRequestData("new-1", [8, 9], SamplingParams(seed=1), [4, 5], 2, [8, 9, 150_000, 11]),
    ]
    cached = CachedRequestData(
        req_ids=["run-0", "run-1", "run-2"],
        resumed_req_ids={"run-2"},
        all_token_ids={"run-1": [1, 2, 3, 4]},
        new_block_ids=[None, [7], [8, 9]],
        num_computed_tokens=[10, 11, 12],
        num_output_tokens=[1, 2, 3],
    )
    if num_scheduled_tokens is None:
        num_scheduled_tokens = {"run-0": 1, "run-1": 1, "run-2": 2, "new-0": 3, "new-1": 4}
    return SchedulerOutput(
        new,
        cached,
        num_scheduled_tokens,
        sum(num_scheduled_tokens.values()),
        {"gone"},
        {"run-3"},
        b"connector",
        GrammarBitmask(["run-0", "run-0"], b"\xff" * 8),  # two rows: its next token and a draft
        {"run-0": [4, 5], "run-1": [-1, -1]},  # drafts, and slots the runner fills
        {"run-2"},  # drafting paused for its next step too
    )


def send_call(so: SchedulerOutput) -> SchedulerOutput:
    call = rpc.decode_call(rpc.encode_call("execute_model", (so,), {}, 0))
    (got,), _ = rpc.decode_args(Worker, call)
    return got


def send_reply(output: ModelRunnerOutput, so: SchedulerOutput) -> ModelRunnerOutput:
    reply = rpc.decode_reply(rpc.encode_reply(True, output, (so,)))
    return rpc.decode_results(Worker, "execute_model", [(0, reply)], (so,))[0]


@pytest.mark.parametrize(
    "num_scheduled_tokens",
    [None, {"new-1": 4, "run-2": 2, "run-0": 1, "new-0": 3, "run-1": 1}],
    ids=["own_order", "other_order"],
)
def test_scheduler_output_round_trip(num_scheduled_tokens: dict[str, int] | None) -> None:
    so = scheduler_output(num_scheduled_tokens)
    got = send_call(so)
    assert got == so
    assert list(got.num_scheduled_tokens) == list(so.num_scheduled_tokens)  # order kept


def test_scheduler_output_wire_leaves_out_what_the_worker_derives() -> None:
    so = scheduler_output()
    w = wire.scheduler_output_to_wire(so, ())
    assert w.num_scheduled_req_ids is None  # the cached then the new requests' own ids
    assert w.num_scheduled_tokens == struct.pack("5i", 1, 1, 2, 3, 4)
    assert w.new_reqs[0].prompt_token_ids == struct.pack("3i", 5, 6, 7)
    assert w.new_reqs[1].prefill_tail == struct.pack("2i", 150_000, 11)
    assert "total_num_scheduled_tokens" not in msgspec.structs.asdict(w)


def test_runner_output_in_scheduled_order_sends_no_ids() -> None:
    so = scheduler_output()
    req_ids = list(so.num_scheduled_tokens)
    output = ModelRunnerOutput(req_ids, [[7], [8], [9], [], [10]])
    payload = rpc.encode_reply(True, output, (so,))
    assert not any(r.encode() in payload for r in req_ids)
    got = send_reply(output, so)
    assert got == output
    assert got.req_ids is not output.req_ids
    assert got.req_id_to_index == {r: i for i, r in enumerate(req_ids)}
    # The engine's own strings: the scheduler's lookups hit without comparing characters.
    assert all(a is b for a, b in zip(got.req_ids, so.num_scheduled_tokens))


def test_runner_output_in_batch_order_sends_positions() -> None:
    so = scheduler_output()
    output = ModelRunnerOutput(
        ["new-1", "run-0", "run-2", "new-0", "run-1"],
        [[1], [2], [3, 4], [], [5]],
        LogprobsLists([[1], [2], [3], [], [5]], [[-0.1], [-0.2], [-0.3], [], [-0.5]], [0] * 5),
        KVConnectorOutput(finished_sending={"x"}),
    )
    w = wire.model_runner_output_to_wire(output, (so,))
    assert w.req_ids is None and w.req_positions == struct.pack("5i", 4, 0, 2, 3, 1)
    assert w.sampled == struct.pack("5i", 1, 2, 3, 4, 5)
    got = send_reply(output, so)
    assert got == output
    assert got.req_id_to_index["run-2"] == 2
    assert got.sampled_token_ids[got.req_id_to_index["new-0"]] == []


def test_runner_output_with_prompt_logprobs_round_trip() -> None:
    so = scheduler_output()
    prompt_logprobs = LogprobsLists([[6, 1], [7, 6]], [[-1.5, -0.25], [-0.125, -3.0]], [4, 1])
    output = ModelRunnerOutput(
        list(so.num_scheduled_tokens),
        [[7], [8], [9], [], [10]],
        prompt_logprobs_dict={"new-0": prompt_logprobs},
        draft_token_ids={"run-0": [3, 1]},  # a drafter's guesses for the next step
        num_filled_drafts={"run-0": 1},  # placeholder slots it filled (async scheduling)
    )
    got = send_reply(output, so)
    assert got == output and got.prompt_logprobs_dict == {"new-0": prompt_logprobs}
    assert got.draft_token_ids == {"run-0": [3, 1]} and got.num_filled_drafts == {"run-0": 1}
    assert send_reply(ModelRunnerOutput(["run-0"], [[1]]), so).prompt_logprobs_dict is None


def test_runner_output_with_an_unscheduled_id_sends_ids() -> None:
    so = scheduler_output()
    output = ModelRunnerOutput(["run-0", "elsewhere"], [[1], [2]])
    assert wire.model_runner_output_to_wire(output, (so,)).req_ids == ["run-0", "elsewhere"]
    assert send_reply(output, so) == output


def test_empty_runner_output_round_trip() -> None:
    so = SchedulerOutput.make_empty()
    got = send_reply(EMPTY_MODEL_RUNNER_OUTPUT, so)
    assert got == EMPTY_MODEL_RUNNER_OUTPUT and got.req_id_to_index == {}


def test_req_id_to_index_is_derived_from_req_ids() -> None:
    output = ModelRunnerOutput(["b", "a"], [[1], [2]])
    assert output.req_id_to_index == {"b": 0, "a": 1}
    given = {"b": 0, "a": 1}
    assert ModelRunnerOutput(["b", "a"], [[1], [2]], req_id_to_index=given).req_id_to_index is given
