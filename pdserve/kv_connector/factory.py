"""KV connectors by name (`kv_transfer_config.kv_connector`): both halves of the configured
connector, or the no-op halves for an instance without one."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdserve.config.plugins import CONNECTORS
from pdserve.kv_connector.base import KVConnectorScheduler, KVConnectorWorker
from pdserve.kv_connector.noop import NoKVConnectorScheduler, NoKVConnectorWorker

if TYPE_CHECKING:
    from pdserve.config import EngineConfig


def create_scheduler_connector(config: EngineConfig) -> KVConnectorScheduler:
    if config.kv_transfer_config is None:
        return NoKVConnectorScheduler()
    return CONNECTORS.get(config.kv_transfer_config.kv_connector).scheduler(config)


def create_worker_connector(config: EngineConfig, tp_rank: int) -> KVConnectorWorker:
    if config.kv_transfer_config is None:
        return NoKVConnectorWorker()
    return CONNECTORS.get(config.kv_transfer_config.kv_connector).worker(config, tp_rank)
