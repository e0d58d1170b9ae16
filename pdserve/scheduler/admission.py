"""Admitting waiting requests into a step: prefix-cache hits, the tokens a KV connector loads,
chunked prefill, and the blocks kept free for parked loads (reference §3.3, step 2).

Waiting requests never preempt: an admission that does not fit ends the step's admissions.
"""

from __future__ import annotations

from typing import NamedTuple

from pdserve.kv_connector.base import KVConnectorScheduler
from pdserve.request import Request, RequestStatus
from pdserve.scheduler.kv_cache_manager import KVCacheManager
from pdserve.scheduler.remote_kv import RemoteKVRequests
from pdserve.scheduler.request_queue import RequestQueue, SchedulingPolicy, create_request_queue
from pdserve.scheduler.running import cut_short
from pdserve.scheduler.stats import PromptTokenSources


class Admissions(NamedTuple):
    # Requests that run from this step on, in admission order (they join `running` so).
    admitted: list[Request]
    # The same, by what they were: new to the workers, or back after preemption.
    new_reqs: list[Request]
    resumed_reqs: list[Request]
    token_budget: int


class WaitingAdmission:
    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        remote_kv: RemoteKVRequests,
        connector: KVConnectorScheduler,
        policy: SchedulingPolicy,
        enable_chunked_prefill: bool,
        alignment: int = 1,
    ) -> None:
        self.kv_cache_manager = kv_cache_manager
        self.alignment = alignment  # where a prompt chunk may end (running.cut_short)
        self.remote_kv = remote_kv
        self.connector = connector
        self.policy = policy
        self.enable_chunked_prefill = enable_chunked_prefill
        self.prompt_token_sources = PromptTokenSources()  # cumulative

    def admit(
        self,
        waiting: RequestQueue,
        token_budget: int,
        num_free_seats: int,
        num_scheduled_tokens: dict[str, int],
    ) -> Admissions:
        """Admit from `waiting` and the parked queue while budget, seats and blocks last;
        records each admission's tokens in `num_scheduled_tokens`."""
        kv_cache_manager = self.kv_cache_manager
        remote_kv = self.remote_kv
        admitted: list[Request] = []
        new_reqs: list[Request] = []
        resumed_reqs: list[Request] = []
        reserved_blocks = remote_kv.num_reserved_blocks()
        step_skipped = create_request_queue(self.policy)
        while (waiting or remote_kv) and token_budget > 0 and len(admitted) < num_free_seats:
            queue = remote_kv.select_queue(waiting)
            request = queue.peek_request()
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                if not remote_kv.try_promote(request):
                    step_skipped.add_request(queue.pop_request())
                    continue

            match = remote_kv.match_computed_tokens(request)
            if match is None:  # the connector cannot tell yet: ask next step
                step_skipped.add_request(queue.pop_request())
                continue
            new_computed_blocks, num_local_computed, num_external_tokens, load_kv_async = match
            num_computed_tokens = request.num_computed_tokens + num_local_computed
            num_computed_tokens += num_external_tokens
            num_new_tokens = 0
            if not load_kv_async:
                num_new_tokens = request.num_tokens - num_computed_tokens
                if num_new_tokens > token_budget:
                    if not self.enable_chunked_prefill:
                        break  # the prompt waits for a step with room for all of it
                    num_new_tokens = cut_short(num_computed_tokens, token_budget, self.alignment)
                if num_new_tokens <= 0:
                    break  # the prompt waits for a step with room for a whole chunk

            # Parked loads keep their blocks to come free (minus this request's own).
            reservation_change = remote_kv.reservation_change(
                request, num_computed_tokens, load_kv_async
            )
            new_blocks = kv_cache_manager.allocate_slots(
                request,
                num_new_tokens,
                num_new_computed_tokens=num_local_computed,
                new_computed_blocks=new_computed_blocks,
                num_external_computed_tokens=num_external_tokens,
                delay_cache_blocks=load_kv_async,
                reserved_blocks=reserved_blocks + reservation_change,
            )
            if new_blocks is None:
                break
            self.connector.update_state_after_alloc(
                request, kv_cache_manager.get_blocks(request.request_id), num_external_tokens
            )
            queue.pop_request()
            reserved_blocks += reservation_change
            if num_local_computed and request.num_cached_tokens < 0:
                request.num_local_cached_tokens = num_local_computed
            if load_kv_async:
                # Parked until the worker reports the transfer done; counted as computed now.
                request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                request.num_computed_tokens = num_computed_tokens
                step_skipped.add_request(request)
                continue

            admitted.append(request)
            if request.status == RequestStatus.WAITING:
                new_reqs.append(request)
            elif request.status == RequestStatus.PREEMPTED:
                resumed_reqs.append(request)
            else:
                raise RuntimeError(f"Invalid request status: {request.status!r}")
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_computed_tokens
            if request.num_cached_tokens < 0:
                self._count_prompt_tokens(request)
            num_scheduled_tokens[request.request_id] = num_new_tokens
            token_budget -= num_new_tokens
        if step_skipped:
            remote_kv.park(step_skipped)
        return Admissions(admitted, new_reqs, resumed_reqs, token_budget)

    def _count_prompt_tokens(self, request: Request) -> None:
        """At its first admission: where the request's prompt KV comes from, and how much of it
        a prefix cache served (docs/kv_connector.md, "Cached tokens").

        Of the prompt, `[0, num_local)` are local prefix-cache hits, `[num_local, num_found)`
        were loaded from a peer, the rest is computed here. The peer's own hits are a prefix
        `[0, num_remote_cached_tokens)` too: the loaded tokens below it were cached there, those
        above it computed for this request. So the cached tokens are the union of the two
        prefixes within what was found, each token counted once."""
        num_prompt = request.num_prompt_tokens
        # Only the prompt counts (a shipped first token may follow it).
        num_found = min(request.num_computed_tokens, num_prompt)
        num_local = min(request.num_local_cached_tokens, num_found)
        num_remote_cached = min(request.num_remote_cached_tokens, num_found)
        request.num_cached_tokens = max(num_local, num_remote_cached)
        sources = self.prompt_token_sources
        sources.local_compute += num_prompt - num_found
        sources.local_cache_hit += num_local
        sources.external_kv_transfer += num_found - num_local
