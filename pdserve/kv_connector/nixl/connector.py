"""NixlConnector: one object per role, delegating to the scheduler or the worker half."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec
import torch

from pdserve.kv_connector.base import KVConnectorBase, KVConnectorRole
from pdserve.kv_connector.nixl.metadata import NixlConnectorMetadata
from pdserve.kv_connector.nixl.scheduler import NixlConnectorScheduler
from pdserve.kv_connector.nixl.worker import NixlConnectorWorker

if TYPE_CHECKING:
    from pdserve.config import EngineConfig
    from pdserve.outputs import KVConnectorOutput
    from pdserve.request import Request
    from pdserve.scheduler.block_pool import KVCacheBlock
    from pdserve.scheduler.output import SchedulerOutput


class NixlConnector(KVConnectorBase):
    def __init__(self, config: EngineConfig, role: KVConnectorRole, tp_rank: int = 0) -> None:
        super().__init__(config, role)
        self.scheduler: NixlConnectorScheduler | None = None
        self.worker: NixlConnectorWorker | None = None
        if role is KVConnectorRole.SCHEDULER:
            self.scheduler = NixlConnectorScheduler(config)
        else:
            self.worker = NixlConnectorWorker(config, tp_rank)

    # ---- scheduler role ---------------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        assert self.scheduler is not None
        self.scheduler.on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: list[KVCacheBlock], num_external_tokens: int
    ) -> None:
        assert self.scheduler is not None
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> NixlConnectorMetadata:
        assert self.scheduler is not None
        return self.scheduler.build_connector_meta(scheduler_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        return self.scheduler.request_finished(request, block_ids)

    def release_remote(self, request_id: str, kv_transfer_params: dict[str, Any]) -> None:
        assert self.scheduler is not None
        self.scheduler.release_remote(request_id, kv_transfer_params)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        assert self.scheduler is not None
        self.scheduler.update_connector_output(output)

    def set_xfer_handshake_metadata(self, metadata: dict[int, bytes]) -> None:
        assert self.scheduler is not None
        self.scheduler.set_xfer_handshake_metadata(metadata)

    def has_pending_transfers(self) -> bool:
        return self.scheduler is not None and self.scheduler.has_pending_transfers()

    def get_stats(self) -> dict[str, float]:
        return self.scheduler.get_stats() if self.scheduler is not None else {}

    # ---- worker role ------------------------------------------------------------------------

    def register_kv_caches(self, kv_cache: torch.Tensor) -> None:
        assert self.worker is not None
        self.worker.register_kv_caches(kv_cache)

    def bind_connector_metadata(self, metadata: bytes) -> None:
        assert self.worker is not None
        self.worker.bind(msgspec.msgpack.decode(metadata, type=NixlConnectorMetadata))

    def start_load_kv(self) -> None:
        assert self.worker is not None
        self.worker.start_load_kv()

    def wait_for_save(self) -> None:
        assert self.worker is not None
        self.worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self.worker is not None
        return self.worker.get_finished()

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self.worker is not None
        return self.worker.take_invalid_block_ids()

    def get_load_errors(self) -> dict[str, str]:
        assert self.worker is not None
        return self.worker.take_load_errors()

    def get_worker_stats(self) -> dict[str, float]:
        assert self.worker is not None
        return self.worker.take_stats()

    def get_handshake_metadata(self) -> bytes | None:
        assert self.worker is not None
        return self.worker.get_handshake_metadata()

    def shutdown(self) -> None:
        for part in (self.scheduler, self.worker):
            if part is not None:
                part.shutdown()
