"""NixlConnector's two halves, as the factory's registry names them."""

from pdserve.kv_connector.base import KVConnectorHalves
from pdserve.kv_connector.nixl.scheduler import NixlConnectorScheduler
from pdserve.kv_connector.nixl.worker import NixlConnectorWorker

NIXL_CONNECTOR = KVConnectorHalves(NixlConnectorScheduler, NixlConnectorWorker)
