"""KV connectors by name (`kv_transfer_config.kv_connector`): both halves of the configured
connector, or the no-op halves for an instance without one."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdserve.kv_connector.base import KVConnectorHalves, KVConnectorScheduler, KVConnectorWorker
from pdserve.kv_connector.noop import NoKVConnectorScheduler, NoKVConnectorWorker
from pdserve.registry import Registry

if TYPE_CHECKING:
    from pdserve.config import EngineConfig

CONNECTORS: Registry[KVConnectorHalves] = Registry(
    "KV connector",
    "kv_transfer_config.kv_connector",
    {
        "NixlConnector": "pdserve.kv_connector.nixl.connector:NIXL_CONNECTOR",
        "NixlPushConnector": "pdserve.kv_connector.nixl.connector:NIXL_PUSH_CONNECTOR",
    },
)


def create_scheduler_connector(config: EngineConfig) -> KVConnectorScheduler:
    if config.kv_transfer_config is None:
        return NoKVConnectorScheduler()
    return CONNECTORS.get(config.kv_transfer_config.kv_connector).scheduler(config)


def create_worker_connector(config: EngineConfig, tp_rank: int) -> KVConnectorWorker:
    if config.kv_transfer_config is None:
        return NoKVConnectorWorker()
    return CONNECTORS.get(config.kv_transfer_config.kv_connector).worker(config, tp_rank)
