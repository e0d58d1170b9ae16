"""Scheduler: continuous batching, token budget, chunked prefill, stop conditions, abort."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from pdserve.config import CacheConfig, SchedulerConfig
from pdserve.outputs import LogprobsLists, ModelRunnerOutput
from pdserve.request import FinishReason, RequestStatus
from pdserve.scheduler.output import SchedulerOutput
from pdserve.scheduler.scheduler import Scheduler
from pdserve.scheduler.step import StepsInFlight

from .conftest import EOS, make_request, run_to_completion, runner_output, step

MakeScheduler = Callable[..., Scheduler]


def test_new_then_cached_requests(make_scheduler: MakeScheduler) -> None:
    scheduler = make_scheduler(max_num_batched_tokens=64)
    for i in range(3):
        scheduler.add_request(make_request(i, prompt=11, max_tokens=3))
    out, outputs = step(scheduler)
    assert [r.req_id for r in out.scheduled_new_reqs] == ["0", "1", "2"]
    assert all(r.num_computed_tokens == 0 and len(r.block_ids) == 3 for r in out.scheduled_new_reqs)
    assert all(r.prefill_token_ids is None for r in out.scheduled_new_reqs)  # runner V1
    assert out.num_scheduled_tokens == {"0": 11, "1": 11, "2": 11}
    assert out.total_num_scheduled_tokens == 33 and out.preempted_req_ids is None
    assert [o.new_token_ids for o in outputs] == [[7], [7], [7]]
    assert all(o.finish_reason is None for o in outputs)

    out, _ = step(scheduler)  # token 12 still fits in the 3rd block
    cached = out.scheduled_cached_reqs
    assert not out.scheduled_new_reqs and cached.req_ids == ["0", "1", "2"]
    assert cached.new_block_ids == [None, None, None]
    assert cached.num_computed_tokens == [11, 11, 11] and cached.num_output_tokens == [1, 1, 1]
    assert not cached.resumed_req_ids and not cached.all_token_ids  # all ran last step
    assert out.total_num_scheduled_tokens == 3

    out, outputs = step(scheduler)  # token 13 needs a 4th block
    assert all(ids is not None and len(ids) == 1 for ids in out.scheduled_cached_reqs.new_block_ids)
    assert all(o.finish_reason == FinishReason.LENGTH for o in outputs)
    assert set(scheduler.finished_req_ids) == {"0", "1", "2"}
    out = scheduler.schedule()
    assert out.finished_req_ids == {"0", "1", "2"} and out.total_num_scheduled_tokens == 0
    assert not scheduler.finished_req_ids and scheduler.finished_req_ids is not out.finished_req_ids


def test_chunked_prefill_splits_the_budget_across_steps(make_scheduler: MakeScheduler) -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8)
    scheduler.add_request(make_request("long", prompt=20, max_tokens=1))
    scheduler.add_request(make_request("short", prompt=6, max_tokens=1))
    out, outputs = step(scheduler)
    assert out.num_scheduled_tokens == {"long": 8} and not outputs
    out, outputs = step(scheduler)
    assert out.num_scheduled_tokens == {"long": 8} and not outputs
    assert out.scheduled_cached_reqs.num_computed_tokens == [8]
    out, outputs = step(scheduler)  # the prompt's last 4 tokens, then a chunk of "short"
    assert out.num_scheduled_tokens == {"long": 4, "short": 4}
    assert [o.request_id for o in outputs] == ["long"]
    out, outputs = step(scheduler)
    assert out.num_scheduled_tokens == {"short": 2} and [o.request_id for o in outputs] == ["short"]
    scheduler.schedule()


def test_without_chunked_prefill_a_prompt_waits_for_room(make_scheduler: MakeScheduler) -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8, enable_chunked_prefill=False)
    scheduler.add_request(make_request("a", prompt=6, max_tokens=3))
    scheduler.add_request(make_request("b", prompt=6, max_tokens=1))
    out, _ = step(scheduler)
    assert out.num_scheduled_tokens == {"a": 6}  # b does not fit in the 2 tokens left
    out, _ = step(scheduler)
    assert out.num_scheduled_tokens == {"a": 1, "b": 6}
    run_to_completion(scheduler)


def test_max_num_seqs(make_scheduler: MakeScheduler) -> None:
    scheduler = make_scheduler(max_num_seqs=2)
    for i in range(3):
        scheduler.add_request(make_request(i, prompt=4, max_tokens=2))
    out, _ = step(scheduler)
    assert list(out.num_scheduled_tokens) == ["0", "1"]
    assert scheduler.make_stats().num_waiting_reqs == 1
    out, _ = step(scheduler)  # both finish
    assert list(out.num_scheduled_tokens) == ["0", "1"]
    out, _ = step(scheduler)
    assert list(out.num_scheduled_tokens) == ["2"] and out.finished_req_ids == {"0", "1"}
    run_to_completion(scheduler)


def test_priority_policy_admits_by_priority_then_arrival(make_scheduler: MakeScheduler) -> None:
    scheduler = make_scheduler(policy="priority", max_num_seqs=3)
    scheduler.add_request(make_request("p2", priority=2, arrival_time=1.0, max_tokens=1))
    scheduler.add_request(make_request("p0_late", priority=0, arrival_time=3.0, max_tokens=1))
    scheduler.add_request(make_request("p1", priority=1, arrival_time=0.5, max_tokens=1))
    scheduler.add_request(make_request("p0", priority=0, arrival_time=2.0, max_tokens=1))
    out, _ = step(scheduler)
    assert [r.req_id for r in out.scheduled_new_reqs] == ["p0", "p0_late", "p1"]
    run_to_completion(scheduler)


def stop_run(
    make_scheduler: MakeScheduler, tokens: list[int], **kwargs: object
) -> tuple[list[int], object]:
    """Feed `tokens` one per step to a single request; returns what it generated and its end."""
    max_model_len = kwargs.pop("max_model_len", 256)
    scheduler = make_scheduler(max_model_len=max_model_len)
    scheduler.add_request(make_request("r", prompt=6, **kwargs))  # type: ignore[arg-type]
    generated, finish = [], None
    for token in tokens:
        _, outputs = step(scheduler, token)
        for o in outputs:
            generated += o.new_token_ids
            finish = (o.finish_reason, o.stop_reason)
        if not scheduler.has_unfinished_requests():
            break
    scheduler.finish_requests("r", RequestStatus.FINISHED_ABORTED)
    scheduler.schedule()
    return generated, finish


def test_stop_conditions(make_scheduler: MakeScheduler) -> None:
    run = lambda tokens, **kw: stop_run(make_scheduler, tokens, **kw)  # noqa: E731
    assert run([5, EOS, 6]) == ([5, EOS], (FinishReason.STOP, None))
    assert run([5, 9, 6], stop_token_ids=[9]) == ([5, 9], (FinishReason.STOP, 9))
    assert run([5, 6, 7, 8], max_tokens=3) == ([5, 6, 7], (FinishReason.LENGTH, None))
    # EOS and stop tokens count only once min_tokens tokens exist.
    assert run([EOS, 9, EOS], min_tokens=2, stop_token_ids=[9]) == (
        [EOS, 9],
        (FinishReason.STOP, 9),
    )
    assert run([EOS, EOS, 5], max_tokens=3, ignore_eos=True) == (
        [EOS, EOS, 5],
        (FinishReason.LENGTH, None),
    )
    # 6 prompt tokens + 4 generated reach max_model_len 10, min_tokens notwithstanding.
    assert run([5] * 8, max_model_len=10, max_tokens=None, min_tokens=8) == (
        [5] * 4,
        (FinishReason.LENGTH, None),
    )


def test_prompt_of_max_model_len_is_prefilled_in_chunks(make_scheduler: MakeScheduler) -> None:
    scheduler = make_scheduler(max_model_len=20, max_num_batched_tokens=16)
    scheduler.add_request(make_request("r", prompt=20))
    assert step(scheduler)[0].num_scheduled_tokens == {"r": 16}
    out, outputs = step(scheduler)
    assert out.num_scheduled_tokens == {"r": 4}
    assert outputs[0].finish_reason == FinishReason.LENGTH and len(outputs[0].new_token_ids) == 1
    scheduler.schedule()


def test_several_tokens_per_step_are_trimmed_at_the_stop(make_scheduler: MakeScheduler) -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("r", prompt=4, max_tokens=2))
    out = scheduler.schedule()
    mro = ModelRunnerOutput(req_ids=["r"], req_id_to_index={"r": 0}, sampled_token_ids=[[5, 6, 7]])
    outputs = scheduler.update_from_output(out, mro)
    assert outputs[0].new_token_ids == [5, 6] and outputs[0].finish_reason == FinishReason.LENGTH
    scheduler.schedule()


def test_logprobs_rows_follow_the_runner_index(make_scheduler: MakeScheduler) -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", prompt=4, max_tokens=1))
    scheduler.add_request(make_request("b", prompt=4, max_tokens=1))
    out = scheduler.schedule()
    mro = ModelRunnerOutput(
        req_ids=["b", "a"],
        req_id_to_index={"b": 0, "a": 1},
        sampled_token_ids=[[11], [10]],
        logprobs=LogprobsLists([[11, 3], [10, 4]], [[-0.1, -2.0], [-0.2, -3.0]], [1, 1]),
    )
    outputs = {o.request_id: o for o in scheduler.update_from_output(out, mro)}
    assert outputs["a"].new_token_ids == [10]
    assert outputs["a"].new_logprobs == LogprobsLists([[10, 4]], [[-0.2, -3.0]], [1])
    assert outputs["b"].new_logprobs == LogprobsLists([[11, 3]], [[-0.1, -2.0]], [1])
    scheduler.schedule()


def test_abort_waiting_running_and_in_flight(make_scheduler: MakeScheduler) -> None:
    scheduler = make_scheduler(max_num_seqs=2)
    for name in ("running", "prefilling", "waiting"):
        scheduler.add_request(make_request(name, prompt=100 if name == "prefilling" else 4))
    out, _ = step(scheduler)
    assert out.num_scheduled_tokens == {"running": 4, "prefilling": 60}
    scheduler.finish_requests(["waiting", "prefilling", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert scheduler.get_num_unfinished_requests() == 1
    # Aborted while a step is in flight: its sampled token is dropped, nothing is emitted.
    out = scheduler.schedule()
    scheduler.finish_requests("running", RequestStatus.FINISHED_ABORTED)
    scheduler.finish_requests("running", RequestStatus.FINISHED_ABORTED)  # twice: ignored
    mro = ModelRunnerOutput(
        req_ids=["running"], req_id_to_index={"running": 0}, sampled_token_ids=[[5]]
    )
    assert scheduler.update_from_output(out, mro) == []
    assert out.finished_req_ids == {"waiting", "prefilling"}
    assert scheduler.schedule().finished_req_ids == {"running"}
    assert not scheduler.has_unfinished_requests()


def test_prefix_hit_in_the_scheduler(make_scheduler: MakeScheduler) -> None:
    scheduler = make_scheduler()
    prompt = list(range(100, 110))
    scheduler.add_request(make_request("a", prompt=prompt, max_tokens=1))
    run_to_completion(scheduler)
    scheduler.add_request(make_request("b", prompt=prompt + [5], max_tokens=1))
    out, outputs = step(scheduler)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 8
    assert out.num_scheduled_tokens == {"b": 3} and outputs[0].num_cached_tokens == 8
    stats = scheduler.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (21, 8)
    scheduler.schedule()
    assert scheduler.reset_prefix_cache()


def test_runner_output_helper_skips_mid_prefill(make_scheduler: MakeScheduler) -> None:
    scheduler = make_scheduler(max_num_batched_tokens=4)
    scheduler.add_request(make_request("r", prompt=6, max_tokens=1))
    out = scheduler.schedule()
    assert runner_output(scheduler, out).sampled_token_ids == [[]]
    assert scheduler.update_from_output(out, runner_output(scheduler, out)) == []
    run_to_completion(scheduler)


def test_duplicate_request_id_is_rejected(make_scheduler: MakeScheduler) -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("r"))
    with pytest.raises(ValueError, match="already in use"):
        scheduler.add_request(make_request("r"))
    scheduler.finish_requests("r", RequestStatus.FINISHED_ABORTED)
    assert scheduler.has_finished_requests() and not scheduler.has_unfinished_requests()
    scheduler.schedule()
    assert not scheduler.has_finished_requests()


def test_budget_defaults_when_the_config_leaves_it_unset() -> None:
    def budget(chunked: bool) -> int:
        scheduler = Scheduler(
            SchedulerConfig(enable_chunked_prefill=chunked), CacheConfig(), 4096, 8, False
        )
        return scheduler.max_num_scheduled_tokens

    assert budget(True) == 2048 and budget(False) == 4096


def test_request_token_counts_follow_the_outputs(make_scheduler: MakeScheduler) -> None:
    scheduler = make_scheduler()
    request = make_request("r", prompt=5, max_tokens=4)
    prompt = list(request.prompt_token_ids)
    scheduler.add_request(request)
    generated = run_to_completion(scheduler, token=lambda r: 100 + r.num_tokens)["r"]
    assert generated == request.output_token_ids == [105, 106, 107, 108]
    assert request.all_token_ids == prompt + generated
    assert (request.num_tokens, request.num_output_tokens) == (9, 4)


@pytest.mark.parametrize("runner_order", ["scheduler", "reversed"])
def test_outputs_follow_the_scheduler_order(
    make_scheduler: MakeScheduler, runner_order: str
) -> None:
    """Whatever order the runner keeps its rows in (runner V1's persistent batch has its own),
    the outputs come in the scheduler's order with each request's own tokens."""
    scheduler = make_scheduler()
    for i in range(3):
        scheduler.add_request(make_request(i, prompt=4, max_tokens=2))
    for _ in range(2):
        out = scheduler.schedule()
        req_ids = list(out.num_scheduled_tokens)
        if runner_order == "reversed":
            req_ids.reverse()
        mro = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[[int(r) + 10] for r in req_ids],
        )
        outputs = scheduler.update_from_output(out, mro)
        assert [(o.request_id, o.new_token_ids) for o in outputs] == [
            ("0", [10]),
            ("1", [11]),
            ("2", [12]),
        ]
    assert not scheduler.has_unfinished_requests()
    scheduler.schedule()


def test_an_output_that_never_comes_back_is_forgotten(make_scheduler: MakeScheduler) -> None:
    """A scheduled step whose output is never processed (its worker failed, or a caller only
    schedules) does not hold up the steps after it."""
    scheduler = make_scheduler()
    scheduler.add_request(make_request("r", prompt=4, max_tokens=3))
    step(scheduler)
    scheduler.schedule()  # its output is dropped: the token it samples never arrives
    assert scheduler.requests["r"].num_output_placeholders == 1
    scheduler.finish_requests("r", RequestStatus.FINISHED_ABORTED)
    out, outputs = step(scheduler)
    assert outputs == [] and out.finished_req_ids == {"r"}
    scheduler.schedule()


def test_steps_in_flight_pair_outputs_with_their_requests() -> None:
    steps = StepsInFlight(maxlen=2)
    a, b, c = (SchedulerOutput.make_empty() for _ in range(3))
    reqs = {name: [make_request(name)] for name in "abc"}
    steps.push(a, reqs["a"], ["a"])
    steps.push(b, reqs["b"], ["b"])
    assert steps.pop(b) == (reqs["b"], ["b"])
    assert steps.pop(a) is None  # it never came back before b: dropped
    for output, name in ((a, "a"), (b, "b"), (c, "c")):
        steps.push(output, reqs[name], [name])
    assert steps.pop(a) is None  # past maxlen: the oldest is forgotten
    assert steps.pop(b) == (reqs["b"], ["b"]) and steps.pop(c) == (reqs["c"], ["c"])
