"""KVTransferConfig: which KV connector an instance runs, and in which role (vLLM's names)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from pdserve.validation import check_choice

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
TRANSPORTS = ("nixl", "ucx")
LOAD_FAILURE_POLICIES = ("fail", "recompute")
_EXTRA_KEYS = {
    "transport",
    "kv_lease_duration",
    "kv_load_failure_policy",
    "enforce_handshake_compat",
    "handshake_timeout",
    "transfer_timeout",
    "ucx_tls",
}


@dataclass
class KVTransferConfig:
    kv_connector: str = "NixlConnector"
    kv_role: str = "kv_both"
    # Names this instance to its peers; random unless given (vLLM's default).
    engine_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from pdserve.kv_connector.factory import KVConnectorFactory

        check_choice(
            "kv_transfer_config.kv_connector", self.kv_connector, KVConnectorFactory.names()
        )
        check_choice("kv_transfer_config.kv_role", self.kv_role, KV_ROLES)
        if not isinstance(self.engine_id, str) or not self.engine_id:
            raise ValueError(
                f"kv_transfer_config.engine_id must be a non-empty string, got {self.engine_id!r}."
            )
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ValueError("kv_transfer_config.kv_connector_extra_config must be an object.")
        unknown = set(self.kv_connector_extra_config) - _EXTRA_KEYS
        if unknown:
            raise ValueError(
                f"kv_transfer_config.kv_connector_extra_config has unknown keys {sorted(unknown)}; "
                f"known: {sorted(_EXTRA_KEYS)}."
            )
        check_choice(
            "kv_transfer_config.kv_connector_extra_config.transport", self.transport, TRANSPORTS
        )
        check_choice(
            "kv_transfer_config.kv_connector_extra_config.kv_load_failure_policy",
            self.kv_load_failure_policy,
            LOAD_FAILURE_POLICIES,
        )
        for name in ("kv_lease_duration", "handshake_timeout", "transfer_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(
                    f"kv_transfer_config.kv_connector_extra_config.{name} must be a positive number "
                    f"of seconds, got {value!r}."
                )
        if self.ucx_tls is not None and (not isinstance(self.ucx_tls, str) or not self.ucx_tls):
            raise ValueError(
                "kv_transfer_config.kv_connector_extra_config.ucx_tls must be a non-empty string."
            )
        if not isinstance(self.enforce_handshake_compat, bool):
            raise ValueError(
                "kv_transfer_config.kv_connector_extra_config.enforce_handshake_compat must be a bool."
            )

    @classmethod
    def from_any(cls, value: KVTransferConfig | dict[str, Any]) -> KVTransferConfig:
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"kv_transfer_config must be an object, got {type(value).__name__}.")
        unknown = set(value) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(
                f"kv_transfer_config has unknown keys {sorted(unknown)}; known: "
                f"{sorted(cls.__dataclass_fields__)}."
            )
        return cls(**value)

    def _extra(self, key: str, default: Any) -> Any:
        return self.kv_connector_extra_config.get(key, default)

    @property
    def transport(self) -> str:
        return self._extra("transport", "nixl")

    @property
    def kv_lease_duration(self) -> float:
        """Seconds a prefill instance holds finished requests' blocks for a reader (vLLM: 30)."""
        return self._extra("kv_lease_duration", 30.0)

    @property
    def kv_load_failure_policy(self) -> str:
        return self._extra("kv_load_failure_policy", "fail")

    @property
    def enforce_handshake_compat(self) -> bool:
        return self._extra("enforce_handshake_compat", True)

    @property
    def handshake_timeout(self) -> float:
        return self._extra("handshake_timeout", 5.0)

    @property
    def transfer_timeout(self) -> float:
        """Seconds a READ may take before it counts as failed (a peer that vanished)."""
        return self._extra("transfer_timeout", 10.0)

    @property
    def ucx_tls(self) -> str | None:
        """UCX transports of the `ucx` backend. The default, shared memory, works on one host;
        between hosts (or network namespaces) give "self,tcp" (or an RDMA transport)."""
        return self._extra("ucx_tls", None)

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")
