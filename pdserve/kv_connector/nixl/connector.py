"""NixlConnector's two halves, and NixlPushConnector's (the same halves in push mode), as the
factory's registry names them."""

from functools import partial

from pdserve.kv_connector.base import KVConnectorHalves
from pdserve.kv_connector.nixl.scheduler import NixlConnectorScheduler
from pdserve.kv_connector.nixl.worker import NixlConnectorWorker

NIXL_CONNECTOR = KVConnectorHalves(NixlConnectorScheduler, NixlConnectorWorker)
NIXL_PUSH_CONNECTOR = KVConnectorHalves(
    partial(NixlConnectorScheduler, push=True), partial(NixlConnectorWorker, push=True)
)
