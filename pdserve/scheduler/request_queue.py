"""Waiting queues: first come first served, or by (priority, arrival time); and which
running request each policy preempts first."""

from __future__ import annotations

import enum
import heapq
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable, Iterator

from pdserve.request import Request, RequestStatus


class SchedulingPolicy(enum.Enum):
    FCFS = "fcfs"
    PRIORITY = "priority"


class RequestQueue(ABC):
    @abstractmethod
    def add_request(self, request: Request) -> None: ...

    @abstractmethod
    def pop_request(self) -> Request: ...

    @abstractmethod
    def peek_request(self) -> Request: ...

    @abstractmethod
    def prepend_request(self, request: Request) -> None:
        """Put a request back where it is served next (FCFS) or where its priority says."""

    @abstractmethod
    def prepend_requests(self, requests: RequestQueue) -> None:
        """Put another queue's requests in front, keeping their order."""

    @abstractmethod
    def remove_request(self, request: Request) -> None: ...

    @abstractmethod
    def remove_requests(self, requests: Iterable[Request]) -> None: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """In the order the requests would be popped."""

    def __bool__(self) -> bool:
        return len(self) > 0


class FCFSRequestQueue(RequestQueue):
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add_request(self, request: Request) -> None:
        self._queue.append(request)

    def pop_request(self) -> Request:
        return self._queue.popleft()

    def peek_request(self) -> Request:
        return self._queue[0]

    def prepend_request(self, request: Request) -> None:
        self._queue.appendleft(request)

    def prepend_requests(self, requests: RequestQueue) -> None:
        self._queue.extendleft(reversed(list(requests)))

    def remove_request(self, request: Request) -> None:
        self._queue.remove(request)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        to_remove = set(requests)
        self._queue = deque(r for r in self._queue if r not in to_remove)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityRequestQueue(RequestQueue):
    """A heap ordered by `Request.__lt__`: lower priority value, then earlier arrival, first."""

    def __init__(self) -> None:
        self._heap: list[Request] = []

    def add_request(self, request: Request) -> None:
        heapq.heappush(self._heap, request)

    def pop_request(self) -> Request:
        return heapq.heappop(self._heap)

    def peek_request(self) -> Request:
        return self._heap[0]

    def prepend_request(self, request: Request) -> None:
        # Priority decides the position: a preempted request is served again by its rank.
        self.add_request(request)

    def prepend_requests(self, requests: RequestQueue) -> None:
        for request in requests:
            self.add_request(request)

    def remove_request(self, request: Request) -> None:
        self._heap.remove(request)
        heapq.heapify(self._heap)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        to_remove = set(requests)
        self._heap = [r for r in self._heap if r not in to_remove]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        heap = self._heap.copy()
        while heap:
            yield heapq.heappop(heap)


def create_request_queue(policy: SchedulingPolicy | str) -> RequestQueue:
    policy = SchedulingPolicy(policy)
    if policy is SchedulingPolicy.PRIORITY:
        return PriorityRequestQueue()
    return FCFSRequestQueue()


def select_victim(running: list[Request], policy: SchedulingPolicy) -> Request:
    """The running request to preempt next: under FCFS the most recently admitted, under
    priority the worst (highest value, latest arrival)."""
    candidates = [r for r in running if r.status == RequestStatus.RUNNING]
    if policy is SchedulingPolicy.PRIORITY:
        return max(candidates, key=lambda r: (r.priority, r.arrival_time))
    return candidates[-1]
