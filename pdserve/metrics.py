"""Prometheus metrics of one instance, all named `pdserve:*` (vLLM's set, under our prefix).

Gauges and cumulative counters come from the scheduler's stats, which the engine sends with
every batch of outputs; latencies are measured in the front end, where the client's clock is.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdserve.scheduler.scheduler import SchedulerStats
from pdserve.scheduler.stats import PromptTokenSources, SpecDecodingStats

if TYPE_CHECKING:
    from pdserve.engine.output_processor import RequestUpdate

_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)


@dataclass
class _RequestTimes:
    arrival: float
    num_prompt_tokens: int
    num_tokens: int = 0
    last_token: float = 0.0


class EngineMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        labels = {"model_name": model_name}
        names = list(labels)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"pdserve:{name}", doc, names, registry=self.registry).labels(**labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"pdserve:{name}", doc, names, registry=self.registry).labels(**labels)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(
                f"pdserve:{name}", doc, names, buckets=_LATENCY_BUCKETS, registry=self.registry
            ).labels(**labels)

        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge(
            "num_requests_waiting", "Requests waiting to be scheduled."
        )
        self.kv_cache_usage = gauge(
            "kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1)."
        )
        self.kv_cache_free_blocks = gauge("kv_cache_free_blocks", "Free KV cache blocks.")
        self.kv_cache_total_blocks = gauge(
            "kv_cache_total_blocks", "KV cache blocks, the null block included."
        )
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.num_preemptions = counter("num_preemptions", "Preemptions by the scheduler.")
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_cache_hits = counter(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache."
        )
        self._prompt_tokens_by_source = Counter(
            "pdserve:prompt_tokens_by_source",
            "Prompt tokens by where their KV came from: computed here, found in the local prefix "
            "cache, loaded from a prefill instance (counted at each request's first admission).",
            [*names, "source"],
            registry=self.registry,
        )
        self.prompt_tokens_by_source = {
            source: self._prompt_tokens_by_source.labels(**labels, source=source)
            for source in PromptTokenSources.__struct_fields__
        }
        spec_docs = {
            "num_drafts": "Speculative decoding: drafts verified.",
            "num_draft_tokens": "Speculative decoding: draft tokens verified.",
            "num_accepted_tokens": "Speculative decoding: draft tokens accepted.",
        }
        self.spec_counters = {
            name: counter(f"spec_decode_{name}", doc) for name, doc in spec_docs.items()
        }
        self._spec_per_position = Counter(
            "pdserve:spec_decode_num_accepted_tokens_per_pos",
            "Speculative decoding: draft tokens accepted at each draft position.",
            [*names, "position"],
            registry=self.registry,
        )
        self.ttft = histogram("time_to_first_token_seconds", "Time to the first generated token.")
        self.itl = histogram("inter_token_latency_seconds", "Time between two generated tokens.")
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to last token.")
        self._finished = Counter(
            "pdserve:request_success",
            "Finished requests by finish reason.",
            [*names, "finished_reason"],
            registry=self.registry,
        )
        kv_docs = {
            "transfers": "KV loads completed (decode side).",
            "transfer_seconds": "Seconds spent in KV loads, start to last byte.",
            "transfer_bytes": "Bytes of KV loaded (push mode, prefill side: written).",
            "transfer_descriptors": "Transport descriptors of KV loads.",
            "failed_transfers": "KV loads that failed (handshake, transfer or timeout).",
            "failed_notifications": "Transport notifications that failed or could not be decoded.",
            "expired_leases": "Held KV blocks freed because no reader came before the lease ended.",
            "handshake_failures": "Side-channel handshakes that failed.",
            "pushes": "Push mode, prefill side: registrations whose every block was written.",
            "failed_pushes": "Push mode, prefill side: registrations that ended unwritten.",
            "push_watchdogs": "Push mode, decode side: pushes given up after a lease of silence.",
        }
        self.kv_counters = {name: counter(f"kv_{name}", doc) for name, doc in kv_docs.items()}
        self.kv_gauges = {
            "staging_free_blocks": gauge("kv_staging_free_blocks", "Free host staging blocks."),
            "staging_total_blocks": gauge("kv_staging_total_blocks", "Host staging blocks."),
        }
        self._labels = labels
        self._last_kv_stats: dict[str, float] = {}
        self._last_stats: SchedulerStats | None = None
        self._requests: dict[str, _RequestTimes] = {}

    def record_scheduler_stats(self, stats: SchedulerStats) -> None:
        self.num_requests_running.set(stats.num_running_reqs)
        self.num_requests_waiting.set(stats.num_waiting_reqs)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        self.kv_cache_free_blocks.set(stats.num_free_blocks)
        self.kv_cache_total_blocks.set(stats.num_blocks)
        last = self._last_stats
        # The engine's counters are cumulative; Prometheus counters only go up by deltas.
        for counter, now, before in (
            (self.num_preemptions, stats.num_preemptions, last.num_preemptions if last else 0),
            (
                self.prefix_cache_queries,
                stats.prefix_cache_queries,
                last.prefix_cache_queries if last else 0,
            ),
            (
                self.prefix_cache_hits,
                stats.prefix_cache_hits,
                last.prefix_cache_hits if last else 0,
            ),
        ):
            if now > before:
                counter.inc(now - before)
        sources = stats.prompt_tokens_by_source
        sources_before = last.prompt_tokens_by_source if last else PromptTokenSources()
        for source, counter in self.prompt_tokens_by_source.items():
            delta = getattr(sources, source) - getattr(sources_before, source)
            if delta > 0:
                counter.inc(delta)
        if stats.spec_decoding is not None:
            self._record_spec_decoding(stats.spec_decoding, last.spec_decoding if last else None)
        self._last_stats = stats

    def _record_spec_decoding(
        self, spec: SpecDecodingStats, before: SpecDecodingStats | None
    ) -> None:
        before = before or SpecDecodingStats()
        for name, counter in self.spec_counters.items():
            delta = getattr(spec, name) - getattr(before, name)
            if delta > 0:
                counter.inc(delta)
        previous = before.accepted_per_position
        for position, count in enumerate(spec.accepted_per_position):
            delta = count - (previous[position] if position < len(previous) else 0)
            if delta > 0:
                self._spec_per_position.labels(**self._labels, position=str(position)).inc(delta)

    def record_kv_connector_stats(self, stats: dict[str, float]) -> None:
        for name, value in stats.items():
            if name in self.kv_gauges:
                self.kv_gauges[name].set(value)
                continue
            delta = value - self._last_kv_stats.get(name, 0.0)
            if name in self.kv_counters and delta > 0:
                self.kv_counters[name].inc(delta)
        self._last_kv_stats = dict(stats)

    def request_started(self, request_id: str, num_prompt_tokens: int) -> None:
        self._requests[request_id] = _RequestTimes(time.monotonic(), num_prompt_tokens)

    def request_updated(self, update: RequestUpdate) -> None:
        """One step of a request: its new tokens and the sequences it finished."""
        times = self._requests.get(update.request_id)
        if times is None:
            return
        now = time.monotonic()
        new_tokens = update.num_new_tokens
        if new_tokens > 0:
            if times.num_tokens == 0:
                self.ttft.observe(now - times.arrival)
            else:
                self.itl.observe((now - times.last_token) / new_tokens)
            self.generation_tokens.inc(new_tokens)
            times.num_tokens += new_tokens
            times.last_token = now
        for reason in update.finish_reasons:
            self._finished.labels(**self._labels, finished_reason=reason).inc()
        if update.finished:
            del self._requests[update.request_id]
            self.e2e.observe(now - times.arrival)
            self.prompt_tokens.inc(times.num_prompt_tokens)

    def request_ended(self, request_id: str, reason: str) -> None:
        """A request that ended without a finished output: aborted, rejected, engine dead."""
        if self._requests.pop(request_id, None) is not None:
            self._finished.labels(**self._labels, finished_reason=reason).inc()
