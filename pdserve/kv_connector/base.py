"""The KV connector contract: one class, two roles (vLLM's KVConnectorBase_V1).

The SCHEDULER role lives in the EngineCore process beside the Scheduler: it decides which
requests load KV from a peer, which hold their blocks for a peer to read, and what each step's
workers must do (the connector metadata). The WORKER role lives in every worker beside the KV
cache: it moves the bytes and reports what finished.
"""

from __future__ import annotations

import abc
import enum
from typing import TYPE_CHECKING, Any

import msgspec
import torch

if TYPE_CHECKING:
    from pdserve.config import EngineConfig
    from pdserve.outputs import KVConnectorOutput
    from pdserve.request import Request
    from pdserve.scheduler.block_pool import KVCacheBlock
    from pdserve.scheduler.output import SchedulerOutput


class KVConnectorRole(enum.Enum):
    SCHEDULER = "scheduler"
    WORKER = "worker"


class KVConnectorBase(abc.ABC):
    def __init__(self, config: EngineConfig, role: KVConnectorRole) -> None:
        if config.kv_transfer_config is None:
            raise ValueError("kv_transfer_config must be set for a KV connector.")
        self.config = config
        self.kv_transfer_config = config.kv_transfer_config
        self.role = role

    # ---- scheduler role ---------------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        """A request arrived (before it waits for admission)."""

    @abc.abstractmethod
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens a peer can provide beyond the local prefix hit, and whether they load
        asynchronously (between steps). None: undecided, ask again next step. No side effects."""

    @abc.abstractmethod
    def update_state_after_alloc(
        self, request: Request, blocks: list[KVCacheBlock], num_external_tokens: int
    ) -> None:
        """The request got its blocks; remember what to load into which."""

    @abc.abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> msgspec.Struct:
        """This step's orders for the workers; resets the per-step state."""

    @abc.abstractmethod
    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Called once when a request finishes: (free its blocks later?, kv_transfer_params)."""

    def release_remote(self, request_id: str, kv_transfer_params: dict[str, Any]) -> None:
        """A request that names remote KV will never be admitted here: let the peer free it."""

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """What the workers reported this step (counters, finished transfers)."""

    def set_xfer_handshake_metadata(self, metadata: dict[int, bytes]) -> None:
        """Each worker rank's handshake payload; a connector that serves peers starts here."""

    def has_pending_transfers(self) -> bool:
        """Whether the workers must keep being polled although nothing is scheduled."""
        return False

    def get_stats(self) -> dict[str, float]:
        """Cumulative counters for /metrics."""
        return {}

    # ---- worker role ------------------------------------------------------------------------

    @abc.abstractmethod
    def register_kv_caches(self, kv_cache: torch.Tensor) -> None:
        """The worker's block-major KV cache [num_blocks, layers, 2, block_size, heads, head_dim]."""

    @abc.abstractmethod
    def bind_connector_metadata(self, metadata: bytes) -> None:
        """The step's encoded metadata, before the forward pass."""

    @abc.abstractmethod
    def start_load_kv(self) -> None:
        """Start the loads the bound metadata asks for (asynchronous)."""

    def wait_for_layer_load(self, layer_index: int) -> None:
        """Block until the layer is loaded; whole-request async loads have nothing to wait for."""

    def save_kv_layer(self, layer_index: int, kv_layer: torch.Tensor) -> None:
        """Push a layer to a peer; pull connectors leave the data where it is."""

    def wait_for_save(self) -> None:
        """Block until the pushes of this step are done."""

    @abc.abstractmethod
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(requests whose blocks peers finished reading, requests whose loads finished)."""

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set()

    def get_load_errors(self) -> dict[str, str]:
        """Why each failed load failed (request id -> a short reason, no addresses), for the
        requests whose blocks `get_block_ids_with_load_errors` reports; each reported once."""
        return {}

    def get_worker_stats(self) -> dict[str, float]:
        """Counters since the last call, summed across workers by the engine."""
        return {}

    def get_handshake_metadata(self) -> bytes | None:
        return None

    def shutdown(self) -> None:
        """Idempotent."""
