"""The proxy's /metrics: requests by how they were served, and the parts of their time to the
first byte as their Server-Timing headers give them."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_TIMING_DESC = {
    # No commas: they separate the header's entries.
    "prefill_leg": "prefill instance: the one-token hop",
    "decode_first_byte": "decode instance: its first token (or whole response)",
    "proxy": "proxy",
}


class ProxyMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests_by_path = Counter(
            "pdserve:proxy_requests",
            "Requests by how they were served: path remote (prefill instance, KV handed over) "
            "or local (the decode instance prefilled), with the reason.",
            ["path", "reason"],
            registry=self.registry,
        )
        self.timing_parts = {
            name: Histogram(
                f"pdserve:pd_{name}_seconds", doc, buckets=_LATENCY_BUCKETS, registry=self.registry
            )
            for name, doc in (
                ("proxy", "The proxy's own part of a request's time to its first byte."),
                ("prefill_leg", "The prefill instance's one-token hop, round trip."),
                ("decode_first_byte", "From the decode hop sent to its first byte back."),
            )
        }

    def server_timing(self, parts: dict[str, float]) -> str:
        """The header's value; each part is also observed in its histogram."""
        for name, seconds in parts.items():
            self.timing_parts[name].observe(seconds)
        return ", ".join(
            f'{name};dur={seconds * 1000:.2f};desc="{_TIMING_DESC[name]}"'
            for name, seconds in parts.items()
        )
