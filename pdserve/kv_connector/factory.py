"""KV connectors by name (`kv_transfer_config.kv_connector`)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from pdserve.kv_connector.base import KVConnectorBase, KVConnectorRole

if TYPE_CHECKING:
    from pdserve.config import EngineConfig


class KVConnectorFactory:
    _registry: dict[str, str] = {
        "NixlConnector": "pdserve.kv_connector.nixl.connector:NixlConnector",
    }

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(cls._registry)

    @classmethod
    def create(
        cls, config: EngineConfig, role: KVConnectorRole, tp_rank: int = 0
    ) -> KVConnectorBase:
        assert config.kv_transfer_config is not None
        module_name, class_name = cls._registry[config.kv_transfer_config.kv_connector].split(":")
        connector_cls = getattr(importlib.import_module(module_name), class_name)
        return connector_cls(config, role, tp_rank)
