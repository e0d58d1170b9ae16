"""Where each prompt's KV came from, counted once per request at its first admission: the
cached tokens its outputs report (usage) and the scheduler's prompt_tokens_by_source."""

from __future__ import annotations

from collections.abc import Callable

from pdserve.scheduler.scheduler import Scheduler
from pdserve.scheduler.stats import PromptTokenSources

from .conftest import make_request, run_to_completion, step

MakeScheduler = Callable[..., Scheduler]


def sources(scheduler: Scheduler) -> tuple[int, int, int]:
    s = scheduler.make_stats().prompt_tokens_by_source
    return s.local_compute, s.local_cache_hit, s.external_kv_transfer


def test_a_repeated_prompt_reports_its_full_blocks_cached(make_scheduler: MakeScheduler) -> None:
    scheduler = make_scheduler()  # blocks of 4 tokens
    prompt = list(range(100, 110))
    scheduler.add_request(make_request("a", prompt=prompt, max_tokens=2))
    _, outputs = step(scheduler)
    assert [o.num_cached_tokens for o in outputs] == [0]
    run_to_completion(scheduler)
    assert sources(scheduler) == (10, 0, 0)
    # Two full blocks hit; the third holds the last token, which is always computed.
    scheduler.add_request(make_request("b", prompt=prompt, max_tokens=3))
    _, first = step(scheduler)
    _, second = step(scheduler)
    assert [o.num_cached_tokens for o in first + second] == [8, 8]
    assert sources(scheduler) == (12, 8, 0)
    run_to_completion(scheduler)
    assert sum(sources(scheduler)) == 20


def test_a_chunked_prompt_is_counted_once(make_scheduler: MakeScheduler) -> None:
    scheduler = make_scheduler(max_num_batched_tokens=16)
    prompt = list(range(200, 260))
    scheduler.add_request(make_request("a", prompt=prompt[:20], max_tokens=1))
    run_to_completion(scheduler)
    scheduler.add_request(make_request("b", prompt=prompt, max_tokens=1))
    step(scheduler)
    step(scheduler)  # the second chunk admits nothing new
    assert sources(scheduler) == (20 + 40, 20, 0)
    run_to_completion(scheduler)
    assert sources(scheduler) == (60, 20, 0)


def test_a_preempted_request_keeps_its_first_admission(make_scheduler: MakeScheduler) -> None:
    scheduler = make_scheduler(num_blocks=4)  # 3 usable blocks of 4 tokens
    requests = [make_request(name, prompt=4, max_tokens=3) for name in "abc"]
    for request in requests:
        scheduler.add_request(request)
    step(scheduler)
    step(scheduler)  # b and c preempted; each comes back to a prefix hit on its own block
    assert scheduler.num_preemptions == 2
    outputs = []
    for _ in range(20):
        if not scheduler.has_unfinished_requests():
            break
        outputs += step(scheduler)[1]
    scheduler.schedule()
    assert all(o.num_cached_tokens == 0 for o in outputs)
    assert sources(scheduler) == (12, 0, 0)


def test_stats_hold_a_snapshot(make_scheduler: MakeScheduler) -> None:
    scheduler = make_scheduler()
    before = scheduler.make_stats()
    scheduler.add_request(make_request("a", prompt=6, max_tokens=1))
    run_to_completion(scheduler)
    assert before.prompt_tokens_by_source == PromptTokenSources()
    assert sources(scheduler) == (6, 0, 0)
