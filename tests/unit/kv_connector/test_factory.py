"""The factory gives both halves of the configured connector, or the no-op halves, whose calls
leave a step exactly as if no connector existed."""

from __future__ import annotations

import pytest

from pdserve.config import EngineConfig
from pdserve.config.plugins import CONNECTORS
from pdserve.kv_connector.factory import create_scheduler_connector, create_worker_connector
from pdserve.kv_connector.nixl.scheduler import NixlConnectorScheduler
from pdserve.kv_connector.nixl.worker import NixlConnectorWorker
from pdserve.kv_connector.noop import NoKVConnectorScheduler, NoKVConnectorWorker
from pdserve.scheduler.output import SchedulerOutput
from tests.unit.kv_connector.halves import kv_config
from tests.unit.scheduler.conftest import make_request


def test_without_kv_transfer_config_both_halves_are_no_ops(model: str) -> None:
    config = EngineConfig.from_engine_args(model=model)
    scheduler, worker = create_scheduler_connector(config), create_worker_connector(config, 0)
    assert isinstance(scheduler, NoKVConnectorScheduler)
    assert isinstance(worker, NoKVConnectorWorker)
    request = make_request("r", [1, 2, 3])
    scheduler.on_new_request(request)
    assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
    step = SchedulerOutput.make_empty()
    assert scheduler.build_connector_meta(step) is None
    assert scheduler.request_finished(request, [1]) == (False, None)
    assert not scheduler.has_pending_transfers() and scheduler.get_stats() is None
    worker.pre_forward(step)
    assert worker.post_forward(step) is None and worker.get_handshake_metadata() is None


def test_named_connector_gives_its_two_halves(model: str) -> None:
    config = kv_config(model, "kv_consumer", "d", transport="ucx")
    scheduler = create_scheduler_connector(config)
    worker = create_worker_connector(config, 0)
    try:
        assert isinstance(scheduler, NixlConnectorScheduler)
        assert isinstance(worker, NixlConnectorWorker)
        assert not scheduler.load_failure_recomputes()
    finally:
        worker.shutdown()
        scheduler.shutdown()


def test_unknown_connector_names_the_field_and_the_choices() -> None:
    assert CONNECTORS.supported_names() == ("NixlConnector", "NixlPushConnector")
    with pytest.raises(ValueError, match=r"kv_transfer_config\.kv_connector must be one of"):
        CONNECTORS.check("LMCacheConnector")
