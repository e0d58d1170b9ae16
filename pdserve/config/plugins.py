"""The pluggable parts a config names, by name: executors, KV connectors, KV transports.

The tables live here, below everything they name, so that validating a config imports none of
the plugins; a plugin's module is imported when its entry is chosen.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdserve.registry import Registry

if TYPE_CHECKING:
    from pdserve.executor.base import Executor
    from pdserve.kv_connector.base import KVConnectorHalves
    from pdserve.kv_connector.transport.base import Transport

EXECUTORS: Registry[type[Executor]] = Registry(
    "executor",
    "distributed_executor_backend",
    {
        "uni": "pdserve.executor.uniproc:UniProcExecutor",
        "mp": "pdserve.executor.multiproc:MultiprocExecutor",
        "ray": "pdserve.executor.ray_executor:RayExecutor",
    },
)
CONNECTORS: Registry[KVConnectorHalves] = Registry(
    "KV connector",
    "kv_transfer_config.kv_connector",
    {
        "NixlConnector": "pdserve.kv_connector.nixl.connector:NIXL_CONNECTOR",
        "NixlPushConnector": "pdserve.kv_connector.nixl.connector:NIXL_PUSH_CONNECTOR",
    },
)
TRANSPORTS: Registry[type[Transport]] = Registry(
    "KV transport",
    "kv_transfer_config.kv_connector_extra_config.transport",
    {
        "nixl": "pdserve.kv_connector.transport.nixl:NixlTransport",
        "ucx": "pdserve.kv_connector.transport.ucx:UcxTransport",
    },
)
