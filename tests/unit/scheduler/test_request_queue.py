"""Waiting queues: FCFS and priority order, prepending, removal."""

from __future__ import annotations

import pytest

from pdserve.scheduler.request_queue import (
    FCFSRequestQueue,
    PriorityRequestQueue,
    SchedulingPolicy,
    create_request_queue,
)

from .conftest import make_request


def ids(queue: object) -> list[str]:
    return [r.request_id for r in queue]  # type: ignore[attr-defined]


def test_factory() -> None:
    assert isinstance(create_request_queue("fcfs"), FCFSRequestQueue)
    assert isinstance(create_request_queue(SchedulingPolicy.PRIORITY), PriorityRequestQueue)
    with pytest.raises(ValueError):
        create_request_queue("lifo")


def test_fcfs() -> None:
    queue = create_request_queue("fcfs")
    a, b, c, d = (make_request(x) for x in "abcd")
    for r in (a, b, c):
        queue.add_request(r)
    assert len(queue) == 3 and queue.peek_request() is a
    queue.prepend_request(d)
    assert ids(queue) == ["d", "a", "b", "c"]
    queue.remove_request(a)
    queue.remove_requests([c])
    assert ids(queue) == ["d", "b"]
    other = create_request_queue("fcfs")
    other.add_request(a)
    other.add_request(c)
    queue.prepend_requests(other)
    assert ids(queue) == ["a", "c", "d", "b"]
    assert [queue.pop_request().request_id for _ in range(4)] == ["a", "c", "d", "b"]
    assert not queue


def test_priority_orders_by_priority_then_arrival() -> None:
    queue = create_request_queue("priority")
    late_urgent = make_request("late_urgent", priority=0, arrival_time=3.0)
    early = make_request("early", priority=1, arrival_time=1.0)
    later = make_request("later", priority=1, arrival_time=2.0)
    for r in (later, early, late_urgent):
        queue.add_request(r)
    assert ids(queue) == ["late_urgent", "early", "later"]
    assert queue.pop_request() is late_urgent
    # Prepending does not jump the queue: priority decides.
    queue.prepend_request(late_urgent)
    queue.prepend_request(make_request("lowest", priority=5, arrival_time=0.0))
    assert ids(queue) == ["late_urgent", "early", "later", "lowest"]
    queue.remove_request(early)
    queue.remove_requests([late_urgent])
    assert queue.peek_request() is later and len(queue) == 2
