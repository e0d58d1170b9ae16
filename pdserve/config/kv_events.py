"""KVEventsConfig: whether and where an instance publishes its KV cache events (vLLM's keys)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdserve.validation import check_choice, check_positive, config_from_dict

PUBLISHERS = ("null", "zmq")


@dataclass
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    # vLLM's default: "zmq" when events are enabled, "null" otherwise.
    publisher: str | None = None
    # Bound when it names no host ("*", "::") or is ipc:// / inproc://, connected to otherwise
    # (vLLM's rule: a publisher may push to a relay instead of being polled).
    endpoint: str = "tcp://*:5557"
    # Where a subscriber that missed batches asks for them again; None: no replay.
    replay_endpoint: str | None = None
    # Batches (steps) kept for replay.
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError("kv_events_config.enable_kv_cache_events must be a bool.")
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        check_choice("kv_events_config.publisher", self.publisher, PUBLISHERS)
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is None and name == "replay_endpoint":
                continue
            if not isinstance(value, str) or not value.startswith(
                ("tcp://", "ipc://", "inproc://")
            ):
                raise ValueError(
                    f"kv_events_config.{name} must be a ZMQ address (tcp://, ipc:// or "
                    f"inproc://), got {value!r}."
                )
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            check_positive(f"kv_events_config.{name}", getattr(self, name))
        if not isinstance(self.topic, str):
            raise ValueError(f"kv_events_config.topic must be a string, got {self.topic!r}.")

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def from_any(cls, value: KVEventsConfig | dict[str, Any]) -> KVEventsConfig:
        return config_from_dict(cls, "kv_events_config", value)
