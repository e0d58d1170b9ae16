"""Host staging: the transport moves host copies of KV blocks whose cache stays on the device.

The scheduler role owns a `StagingPool` of the staging buffer's block ids, one block list per
request that holds any. The worker role owns the buffer itself (`HostBuffer`, shaped like the
cache, as many blocks as the pool) and copies blocks between it and the cache. The copy path is
the same for every device; only `_copy_stream` knows about CUDA, so the CPU suite runs
everything around it.

A request's staging blocks go back on every terminal path. Prefill side: taken at admission
(a full pool holds admissions back), filled after the forward pass that completes the prompt,
read under the request's lease once it finished (its device blocks are free by then); back
when the reader is done or the lease expired, or at once when it aborts. Decode side: taken at
admission for the blocks it reads, back when the read ends, however it ends.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from pdserve.kv_connector.nixl.metadata import SaveReqMeta
from pdserve.utils import cdiv

if TYPE_CHECKING:
    from pdserve.request import Request
    from pdserve.scheduler.output import SchedulerOutput


class StagingPool:
    """Scheduler role: the staging buffer's block ids, by request."""

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int) -> None:
        self.block_size = block_size
        needed = self.blocks_for(max_model_len)
        if num_blocks < needed:
            raise ValueError(
                "kv_transfer_config.kv_connector_extra_config.host_buffer_blocks must hold one "
                f"request of max_model_len {max_model_len} ({needed} blocks), got {num_blocks}."
            )
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._held: dict[str, list[int]] = {}
        # Prefill side: the requests holding blocks, and of those the ones whose prompt is not
        # computed yet, with their block table so far (followed through the step outputs).
        self._saves: set[str] = set()
        self._to_save: dict[str, tuple[Request, list[int]]] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def get(self, req_id: str) -> list[int] | None:
        return self._held.get(req_id)

    def _allocate(self, req_id: str, n: int) -> list[int]:
        assert req_id not in self._held and n <= len(self._free), (req_id, n, len(self._free))
        ids = [self._free.popleft() for _ in range(n)]
        self._held[req_id] = ids
        return ids

    def _free_blocks(self, req_id: str) -> None:
        self._free.extend(self._held.pop(req_id, ()))

    # ---- prefill side ---------------------------------------------------------------------

    def holds_save(self, req_id: str) -> bool:
        return req_id in self._saves

    def can_save(self, request: Request) -> bool:
        return self.blocks_for(request.num_prompt_tokens) <= self.num_free

    def reserve_save(self, request: Request) -> None:
        self._allocate(request.request_id, self.blocks_for(request.num_prompt_tokens))
        self._saves.add(request.request_id)
        self._to_save[request.request_id] = (request, [])

    def save_orders(self, scheduler_output: SchedulerOutput) -> dict[str, SaveReqMeta]:
        """The staging copies of the requests whose prompt this step completes."""
        if not self._to_save:
            return {}
        progress = []
        for new in scheduler_output.scheduled_new_reqs:
            if new.req_id in self._to_save:
                self._to_save[new.req_id][1][:] = new.block_ids
                progress.append((new.req_id, new.num_computed_tokens))
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, new_ids, num_computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens
        ):
            if req_id in self._to_save:
                table = self._to_save[req_id][1]
                if req_id in cached.resumed_req_ids:  # its new ids replace the table
                    table.clear()
                table.extend(new_ids or ())
                progress.append((req_id, num_computed))
        orders = {}
        for req_id, num_computed in progress:
            request, table = self._to_save[req_id]
            num_tokens = num_computed + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            if num_tokens >= request.num_prompt_tokens:
                staging_ids = self._held[req_id]
                orders[req_id] = SaveReqMeta(table[: len(staging_ids)], staging_ids)
                del self._to_save[req_id]
        return orders

    def end_save(self, request: Request, will_be_read: bool) -> list[int] | None:
        """The request finished: its staging ids, held for the reader, if its prompt was saved
        and a reader will come; otherwise its blocks go back and None."""
        unsaved = self._to_save.pop(request.request_id, None) is not None
        if will_be_read and not unsaved:
            return self._held[request.request_id]
        self.sent({request.request_id})
        return None

    def sent(self, req_ids: set[str]) -> set[str]:
        """Prefill requests whose reader is done or whose lease expired: their blocks go back.
        Returns those of `req_ids` that were staged."""
        staged = req_ids & self._saves
        for req_id in staged:
            self._saves.remove(req_id)
            self._free_blocks(req_id)
        return staged

    # ---- decode side ----------------------------------------------------------------------

    def can_read(self, request: Request, num_computed_tokens: int) -> bool:
        """Room for the blocks beyond a local prefix hit of `num_computed_tokens`."""
        num_reads = self.blocks_for(request.num_prompt_tokens) - (
            num_computed_tokens // self.block_size
        )
        return num_reads <= self.num_free

    def reserve_read(self, req_id: str, n: int) -> list[int]:
        return self._allocate(req_id, n)

    def read_ended(self, req_id: str) -> None:
        """The request's READ ended (done, failed or never started): its blocks go back."""
        if req_id not in self._saves:
            self._free_blocks(req_id)


class HostBuffer:
    """The staging buffer of one worker: `num_blocks` blocks laid out as the KV cache's, in
    host memory (pinned when the cache is on CUDA), registered with the transport instead of the
    cache."""

    def __init__(self, kv_cache: torch.Tensor, num_blocks: int) -> None:
        self.kv_cache = kv_cache
        self.tensor = torch.empty(
            (num_blocks, *kv_cache.shape[1:]), dtype=kv_cache.dtype, pin_memory=kv_cache.is_cuda
        )

    def save(self, block_ids: list[int], staging_ids: list[int]) -> None:
        """Cache -> staging (prefill side), after the forward pass that wrote the blocks."""
        copy_blocks(self.kv_cache, block_ids, self.tensor, staging_ids)

    def load(self, staging_ids: list[int], block_ids: list[int]) -> None:
        """Staging -> cache (decode side), once a READ landed."""
        copy_blocks(self.tensor, staging_ids, self.kv_cache, block_ids)


def copy_blocks(
    src: torch.Tensor, src_ids: list[int], dst: torch.Tensor, dst_ids: list[int]
) -> None:
    """dst[dst_ids[i]] = src[src_ids[i]] for every i, complete when this returns."""
    assert len(src_ids) == len(dst_ids), (len(src_ids), len(dst_ids))
    if not src_ids:
        return
    with _copy_stream(src if src.is_cuda else dst):
        blocks = src.index_select(0, torch.tensor(src_ids, device=src.device))
        moved = blocks.to(dst.device, non_blocking=True)
        dst.index_copy_(0, torch.tensor(dst_ids, device=dst.device), moved)


@contextlib.contextmanager
def _copy_stream(tensor: torch.Tensor) -> Iterator[None]:
    """Where CUDA differs: the copies run on a stream of their own, after the work already
    queued on the compute stream (a save reads what this step's forward pass wrote), between
    pinned host memory and the device (so the host side is DMA), and they are waited for
    before the caller reports the blocks saved or loaded. On CPU a copy is done when it
    returns."""
    if not tensor.is_cuda:
        yield
        return
    stream = torch.cuda.Stream(tensor.device)
    stream.wait_stream(torch.cuda.current_stream(tensor.device))
    with torch.cuda.stream(stream):
        yield
    stream.synchronize()
