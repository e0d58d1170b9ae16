"""The connector of an instance without one (vLLM's Model Runner V2 does the same): every call
is a no-op, so the scheduler, the engine and the workers never ask whether a connector exists."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from pdserve.kv_transfer_params import KVTransferParams
    from pdserve.outputs import KVConnectorOutput
    from pdserve.request import Request
    from pdserve.scheduler.block_pool import KVCacheBlock
    from pdserve.scheduler.output import SchedulerOutput


class NoKVConnectorScheduler:
    def on_new_request(self, request: Request) -> None:
        pass

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(
        self, request: Request, blocks: list[KVCacheBlock], num_external_tokens: int
    ) -> None:
        pass

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> bytes | None:
        return None

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, KVTransferParams | None]:
        return False, None

    def release_remote(self, request_id: str, params: KVTransferParams) -> bool:
        return False

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        pass

    def set_xfer_handshake_metadata(self, metadata: dict[int, bytes | None]) -> None:
        pass

    def has_pending_transfers(self) -> bool:
        return False

    def idle_poll_s(self) -> float | None:
        return None

    def load_failure_recomputes(self) -> bool:
        return False

    def get_stats(self) -> dict[str, float] | None:
        return None

    def shutdown(self) -> None:
        pass


class NoKVConnectorWorker:
    def register_kv_caches(self, kv_cache: torch.Tensor) -> None:
        pass

    def get_handshake_metadata(self) -> bytes | None:
        return None

    def pre_forward(self, scheduler_output: SchedulerOutput) -> None:
        pass

    def post_forward(self, scheduler_output: SchedulerOutput) -> KVConnectorOutput | None:
        return None

    def shutdown(self) -> None:
        pass
