"""KVTransferConfig: which KV connector an instance runs, and in which role (vLLM's names)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

import torch

from pdserve.config.plugins import CONNECTORS, TRANSPORTS
from pdserve.validation import check_choice, config_from_dict

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
LOAD_FAILURE_POLICIES = ("fail", "recompute")
KV_BUFFER_DEVICES = ("cuda", "cpu")
_EXTRA_KEYS = {
    "host_staging",
    "host_buffer_blocks",
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
    # Where the memory the transport moves lives (vLLM's key): "cuda" registers a CUDA KV cache
    # itself, "cpu" moves host memory (the cache itself on CPU, pinned staging copies of a CUDA
    # cache). None: the engine's device.
    kv_buffer_device: str | None = None

    def __post_init__(self) -> None:
        CONNECTORS.check(self.kv_connector)
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
        TRANSPORTS.check(self.transport)
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
        self._check_buffer()

    def _check_buffer(self) -> None:
        if self.kv_buffer_device is not None:
            check_choice(
                "kv_transfer_config.kv_buffer_device", self.kv_buffer_device, KV_BUFFER_DEVICES
            )
        if self.kv_buffer_device == "cuda" and not torch.cuda.is_available():
            raise ValueError(
                "kv_transfer_config.kv_buffer_device is 'cuda' but torch sees no CUDA device; "
                "use 'cpu'."
            )
        staging = self._extra("host_staging", None)
        if staging is not None and not isinstance(staging, bool):
            raise ValueError(
                "kv_transfer_config.kv_connector_extra_config.host_staging must be a bool, got "
                f"{staging!r}."
            )
        if staging and self.kv_buffer_device == "cuda":
            raise ValueError(
                "kv_transfer_config.kv_connector_extra_config.host_staging stages through host "
                "memory; it needs kv_buffer_device 'cpu', not 'cuda'."
            )
        blocks = self.host_buffer_blocks
        if blocks is not None and (
            isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 1
        ):
            raise ValueError(
                "kv_transfer_config.kv_connector_extra_config.host_buffer_blocks must be a "
                f"positive integer, got {blocks!r}."
            )

    @classmethod
    def from_any(cls, value: KVTransferConfig | dict[str, Any]) -> KVTransferConfig:
        return config_from_dict(cls, "kv_transfer_config", value)

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

    def buffer_device(self, device: str) -> str:
        """kv_buffer_device on an engine whose KV cache is on `device` ("cpu" or "cuda")."""
        return self.kv_buffer_device or device

    def uses_host_staging(self, device: str) -> bool:
        """Whether the transport moves host copies of the KV cache rather than the cache: a CUDA
        cache with kv_buffer_device "cpu", or `host_staging` forced on (a CPU cache then takes
        the same path, which is how the CPU suite runs it)."""
        buffer = self.buffer_device(device)
        staging = self._extra("host_staging", None)
        if staging is False and buffer == "cpu" and device == "cuda":
            raise ValueError(
                "kv_transfer_config.kv_connector_extra_config.host_staging is false, but a CUDA "
                "KV cache with kv_buffer_device 'cpu' is only reachable through host staging."
            )
        if buffer == "cuda" and device != "cuda":
            raise ValueError(
                f"kv_transfer_config.kv_buffer_device is 'cuda' but the KV cache is on {device!r}."
            )
        return buffer == "cpu" and (device == "cuda" or bool(staging))

    @property
    def host_buffer_blocks(self) -> int | None:
        """Blocks of the host staging buffer (and of the scheduler's staging pool); None: as
        many as the KV cache has."""
        return self._extra("host_buffer_blocks", None)
