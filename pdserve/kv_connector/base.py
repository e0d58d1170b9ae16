"""The KV connector contract: one protocol per role, the two halves of one connector.

The scheduler half (`KVConnectorScheduler`) lives in the EngineCore process beside the
Scheduler: it decides which requests load KV from a peer, which hold their blocks for a peer to
read, and what each step's workers must do (the connector metadata, encoded by it). The worker
half (`KVConnectorWorker`) lives in every worker beside the KV cache: it decodes that metadata,
moves the bytes and reports what finished. `factory.py` builds both halves of the configured
connector, or the no-op ones (`noop.py`) for an instance without one, so no caller ever asks
whether a connector exists.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple, Protocol

if TYPE_CHECKING:
    import torch

    from pdserve.config import EngineConfig
    from pdserve.kv_transfer_params import KVTransferParams
    from pdserve.outputs import KVConnectorOutput
    from pdserve.request import Request
    from pdserve.scheduler.block_pool import KVCacheBlock
    from pdserve.scheduler.output import SchedulerOutput


class KVConnectorScheduler(Protocol):
    def on_new_request(self, request: Request) -> None:
        """A request arrived (before it waits for admission)."""

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens a peer can provide beyond the local prefix hit, and whether they load
        asynchronously (between steps). None: undecided, ask again next step. No side effects."""

    def update_state_after_alloc(
        self, request: Request, blocks: list[KVCacheBlock], num_external_tokens: int
    ) -> None:
        """The request got its blocks; remember what to load into which."""

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> bytes | None:
        """This step's orders for the workers, encoded (None: nothing to say); resets the
        per-step state."""

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, KVTransferParams | None]:
        """Called once when a request finishes: (free its blocks later?, kv_transfer_params)."""

    def release_remote(self, request_id: str, params: KVTransferParams) -> bool:
        """A request that names remote KV will never be admitted here: let the peer free it.
        False when this instance cannot reach peers (no connector)."""

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """What the workers reported this step (counters, finished transfers)."""

    def set_xfer_handshake_metadata(self, metadata: dict[int, bytes | None]) -> None:
        """Each worker rank's handshake payload; a connector that serves peers starts here."""

    def has_pending_transfers(self) -> bool:
        """Whether the workers must keep being polled although nothing is scheduled."""

    def idle_poll_s(self) -> float | None:
        """How often an idle engine must still poll the workers, for what peers send them that
        this half does not know of; None: never."""

    def load_failure_recomputes(self) -> bool:
        """Whether a failed load is recomputed locally (kv_load_failure_policy=recompute)
        rather than failing its request."""

    def get_stats(self) -> dict[str, float] | None:
        """Cumulative counters for /metrics; None without a connector."""

    def shutdown(self) -> None:
        """Idempotent."""


class KVConnectorWorker(Protocol):
    def register_kv_caches(self, kv_cache: torch.Tensor) -> None:
        """The worker's block-major KV cache [num_blocks, layers, 2, block_size, heads, head_dim]."""

    def get_handshake_metadata(self) -> bytes | None:
        """What a peer's handshake gets from this rank (served by the scheduler half)."""

    def pre_forward(self, scheduler_output: SchedulerOutput) -> None:
        """Before the step's forward pass: take the step's metadata and start its loads
        (pull loads are whole requests parked by the scheduler: no layer waits for them)."""

    def post_forward(self, scheduler_output: SchedulerOutput) -> KVConnectorOutput | None:
        """After the forward pass: wait for this step's pushes, and report finished transfers,
        failed loads and counters (None: nothing to report)."""

    def shutdown(self) -> None:
        """Idempotent."""


class KVConnectorHalves(NamedTuple):
    """What a connector registers: how to build each half."""

    scheduler: Callable[[EngineConfig], KVConnectorScheduler]
    worker: Callable[[EngineConfig, int], KVConnectorWorker]  # (config, tp_rank)
