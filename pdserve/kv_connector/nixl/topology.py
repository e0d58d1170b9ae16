"""Heterogeneous TP: which prefill ranks a decode rank reads, and where their bytes land.

With equal TP, decode rank r reads prefill rank r's blocks straight into its cache. Otherwise
the blocks go to a registered staging area and this rank's heads are copied out:
- decode TP = r x prefill TP: a prefill rank holds the heads of r decode ranks; each of those
  reads the whole blocks and keeps its slice (the prefill side waits for r readers);
- prefill TP = k x decode TP: a decode rank reads the same blocks from k prefill ranks, each
  with a slice of its heads, and joins them.
Staging rows are laid out [remote rank j][block id], so runs of blocks stay contiguous. They
live where the registered memory does: on the cache's device, or in (pinned) host memory when
the transport moves host memory (kv_buffer_device "cpu").

A latent cache (MLA: one part per block, no heads to split) is the same on every rank: a decode
rank reads whole blocks straight into its cache from the first prefill rank of its share, and
the others of its share only hear that it is done (vLLM's replicated-KV rule).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.kv_connector.nixl.metadata import AgentMetadata
from pdserve.kv_connector.transport.base import Transport


@dataclass
class RemoteEngine:
    engine_id: str
    tp_size: int
    agents: list[tuple[str, AgentMetadata]]  # (agent name, metadata) of each rank read
    epoch: str = ""  # the incarnation that answered the handshake


class Topology:
    def __init__(
        self,
        kv_cache: torch.Tensor,
        tp_rank: int,
        tp_size: int,
        transport: Transport,
        buffer_device: torch.device,
    ) -> None:
        self.kv_cache = kv_cache
        self.buffer_device = buffer_device
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.transport = transport
        self.num_blocks = kv_cache.shape[0]
        self.num_kv_heads = kv_cache.shape[4]
        self.latent = kv_cache.shape[2] == 1
        self._staging: dict[int, tuple[int, torch.Tensor]] = {}  # remote TP -> (region, tensor)

    def remote_ranks(self, remote_tp: int) -> list[int]:
        tp = self.tp_size
        if remote_tp <= tp:
            if tp % remote_tp:
                raise ValueError(f"prefill TP {remote_tp} does not divide decode TP {tp}")
            return [self.tp_rank // (tp // remote_tp)]
        if remote_tp % tp:
            raise ValueError(f"decode TP {tp} does not divide prefill TP {remote_tp}")
        k = remote_tp // tp
        return list(range(self.tp_rank * k, (self.tp_rank + 1) * k))

    def readers_per_remote_rank(self, remote_tp: int) -> int:
        return max(1, self.tp_size // remote_tp)

    def reads_from(self, j: int) -> bool:
        """Whether the j-th of remote_ranks() is read (else it is only told the read is done)."""
        return j == 0 or not self.latent

    def check_compatible(self, remote: AgentMetadata, remote_tp: int) -> None:
        cache = self.kv_cache
        mine = {
            "block_size": cache.shape[3],
            "num_layers": cache.shape[1],
            "head_dim": cache.shape[5],
        }
        theirs = {
            "block_size": remote.block_size,
            "num_layers": remote.num_layers,
            "head_dim": remote.head_dim,
        }
        for name, value in mine.items():
            if theirs[name] != value:
                raise ValueError(
                    f"the prefill instance has {name}={theirs[name]}, this one {value}"
                )
        if self.latent:
            if remote.num_kv_heads != self.num_kv_heads:
                raise ValueError(
                    f"latent KV heads differ: prefill {remote.num_kv_heads}, decode "
                    f"{self.num_kv_heads}"
                )
        elif remote.num_kv_heads * remote_tp != self.num_kv_heads * self.tp_size:
            raise ValueError(
                f"KV heads differ: prefill {remote.num_kv_heads} x TP {remote_tp}, decode "
                f"{self.num_kv_heads} x TP {self.tp_size}"
            )

    def read_target(
        self, local_ids: list[int], j: int, remote_tp: int, remote_block_len: int
    ) -> tuple[int, list[int]]:
        """(local region, block indices of `remote_block_len` bytes) for reads from remote rank j."""
        if remote_tp == self.tp_size or self.latent:
            return 0, local_ids
        region, _ = self._staging_for(remote_tp, remote_block_len)
        return region, [j * self.num_blocks + b for b in local_ids]

    def _staging_for(self, remote_tp: int, remote_block_len: int) -> tuple[int, torch.Tensor]:
        if remote_tp not in self._staging:
            rows = len(self.remote_ranks(remote_tp))
            tensor = torch.empty(
                rows * self.num_blocks * remote_block_len,
                dtype=torch.uint8,
                device=self.buffer_device,
                pin_memory=self.buffer_device.type == "cpu" and self.kv_cache.is_cuda,
            )
            self._staging[remote_tp] = (self.transport.register_region(tensor), tensor)
        return self._staging[remote_tp]

    def finish(self, local_ids: list[int], remote_tp: int) -> None:
        """Copy this rank's heads from staging into the cache once every read arrived."""
        if remote_tp == self.tp_size or self.latent:
            return
        _, raw = self._staging[remote_tp]
        cache = self.kv_cache
        idx = torch.tensor(local_ids, dtype=torch.long, device=raw.device)
        dst = idx.to(cache.device)  # from host staging to a CUDA cache the heads cross here
        per_block = cache[0].numel() * self.tp_size // remote_tp  # elements of one remote block
        heads = self.num_kv_heads
        if remote_tp < self.tp_size:
            ratio = self.tp_size // remote_tp
            staging = raw.view(cache.dtype)[: self.num_blocks * per_block].view(
                self.num_blocks, *cache.shape[1:4], heads * ratio, cache.shape[5]
            )
            off = (self.tp_rank % ratio) * heads
            cache[dst] = staging[idx, :, :, :, off : off + heads].to(cache.device)
        else:
            k = remote_tp // self.tp_size
            part = heads // k
            staging = raw.view(cache.dtype).view(
                k, self.num_blocks, *cache.shape[1:4], part, cache.shape[5]
            )
            for j in range(k):
                cache[dst, :, :, :, j * part : (j + 1) * part] = staging[j, idx].to(cache.device)
