"""Transport over a NIXL agent and its UCX backend: one-sided READs and WRITEs, NIXL's own
notifications."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import msgspec
import numpy as np
import torch

# NIXL logs every agent's creation at INFO on stdout, into the server's output; quiet unless
# the user asked for a level.
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

# The `nixl` meta package picks the wheel that matches the CUDA found; without it (what
# `pip install pdserve` gives: its own dependencies would pull the CUDA 13 variant) the CUDA 12
# wheel's own modules serve.
try:
    from nixl import _bindings
    from nixl._api import nixl_agent, nixl_agent_config, nixl_xfer_handle
except ImportError:
    from nixl_cu12 import _bindings
    from nixl_cu12._api import nixl_agent, nixl_agent_config, nixl_xfer_handle

from pdserve.kv_connector.transport.base import (
    Desc,
    MemoryKind,
    Transport,
    XferOp,
    XferState,
    check_descs,
)

logger = logging.getLogger(__name__)

# NIXL raises one exception class per status, with no common base below Exception.
_NIXL_ERRORS = tuple(
    getattr(_bindings, n) for n in dir(_bindings) if n.startswith("nixl") and n.endswith("Error")
)
_STATES = {"DONE": XferState.DONE, "PROC": XferState.PENDING, "ERR": XferState.ERROR}
_agent_lock = threading.Lock()
# NIXL's memory segment of each kind: host memory is DRAM, CUDA memory VRAM.
MEM_TYPES = {"host": "DRAM", "device": "VRAM"}


class Region(msgspec.Struct, array_like=True, frozen=True):
    base: int  # remote descriptors are addresses
    size: int
    kind: MemoryKind  # a descriptor names its segment (DRAM or VRAM) and device


class NixlAgentMetadata(msgspec.Struct, array_like=True, frozen=True):
    name: str
    nixl: bytes  # nixl_agent.get_agent_metadata(): connection info and memory keys
    regions: list[Region]


@dataclass
class _Peer:
    metadata: bytes
    regions: list[Region]


@dataclass
class _Xfer:
    op: XferOp
    remote_agent: str
    started: float
    handle: nixl_xfer_handle | None  # None when NIXL refused the transfer up front
    state: XferState = XferState.PENDING


def xfer_descs(descs: list[Desc], regions: list[Region]) -> tuple[np.ndarray, str]:
    """NIXL's Nx3 descriptor array, (address, length, device index) per descriptor, and the
    segment they lie in; a NIXL descriptor list holds one segment, so a side of a READ must
    lie in memory of one kind."""
    kinds = {regions[d.region].kind for d in descs}
    if len(kinds) > 1:
        raise ValueError(
            f"a transfer's descriptors on one side lie in {', '.join(sorted(map(str, kinds)))} "
            "memory; one kind per side."
        )
    (kind,) = kinds
    rows = [(regions[d.region].base + d.offset, d.length, kind.device_index) for d in descs]
    return np.array(rows, np.uint64), MEM_TYPES[kind.kind]


@contextmanager
def _progress_delay(delay_us: int) -> Iterator[None]:
    """Create NIXL agents whose progress thread waits `delay_us` between idle polls.

    nixl_agent hard-codes a delay of 0, which makes the UCX backend's progress thread spin a
    whole core while idle; the binding is swapped only for the constructor call.
    """
    make = _bindings.nixlAgent

    def with_delay(name: str, config: _bindings.nixlAgentConfig) -> _bindings.nixlAgent:
        config.pthrDelay = delay_us
        return make(name, config)

    with _agent_lock:
        _bindings.nixlAgent = with_delay
        try:
            yield
        finally:
            _bindings.nixlAgent = make


class NixlTransport(Transport):
    name = "nixl"

    def __init__(
        self,
        agent_name: str,
        timeout_s: float = 10.0,
        progress_delay_us: int = 10_000,
    ) -> None:
        super().__init__(agent_name, timeout_s)
        # NIXL's metadata carries its own connection info.
        with _progress_delay(progress_delay_us):
            self._agent = nixl_agent(agent_name, nixl_agent_config(backends=["UCX"]))
        if "VRAM_SEG" not in self._agent.get_backend_mem_types("UCX"):
            self.no_device_reason = "NIXL's UCX backend lists no VRAM segment"
        elif torch.cuda.is_available():
            self.no_device_reason = None
        self._regs: list[object] = []
        self._peers: dict[str, _Peer] = {}
        self._xfers: dict[int, _Xfer] = {}
        self._next_handle = 0
        self._closed = False

    def register_region(self, tensor: torch.Tensor) -> int:
        region = self._add_region(tensor)
        kind = self._kinds[region]
        entry = (tensor.data_ptr(), tensor.nbytes, kind.device_index, "")
        self._regs.append(self._agent.register_memory([entry], MEM_TYPES[kind.kind]))
        return region

    def _regions(self) -> list[Region]:
        return [
            Region(t.data_ptr(), size, kind)
            for t, size, kind in zip(self._tensors, self._region_sizes(), self._kinds)
        ]

    def get_agent_metadata(self) -> bytes:
        md = NixlAgentMetadata(self.agent_name, self._agent.get_agent_metadata(), self._regions())
        return msgspec.msgpack.encode(md)

    def add_remote_agent(self, metadata: bytes) -> str:
        try:
            md = msgspec.msgpack.decode(metadata, type=NixlAgentMetadata)
        except msgspec.DecodeError as e:
            raise ValueError(f"not NIXL transport metadata: {e}") from e
        known = self._peers.get(md.name)
        if known is not None and known.metadata == metadata:
            return md.name
        if known is not None:  # the peer restarted: its keys and addresses changed
            self.remove_remote_agent(md.name)
        self._agent.add_remote_agent(md.nixl)
        self._peers[md.name] = _Peer(metadata, md.regions)
        return md.name

    def remove_remote_agent(self, agent_name: str) -> None:
        if self._peers.pop(agent_name, None) is None:
            return
        for xfer in self._xfers.values():
            if xfer.remote_agent == agent_name and xfer.state is XferState.PENDING:
                xfer.state = XferState.ERROR
        try:
            self._agent.remove_remote_agent(agent_name)
        except _NIXL_ERRORS as e:
            logger.warning("NIXL could not forget agent %s: %s", agent_name, e)

    def post(
        self, op: XferOp, remote_agent: str, local: list[Desc], remote: list[Desc], notif: bytes
    ) -> int:
        peer = self._peers.get(remote_agent)
        if peer is None:
            raise ValueError(f"unknown agent {remote_agent!r}; add_remote_agent it first.")
        check_descs(local, remote, self._region_sizes(), [r.size for r in peer.regions])
        local_rows, local_mem = xfer_descs(local, self._regions())
        remote_rows, remote_mem = xfer_descs(remote, peer.regions)
        self._next_handle += 1
        xfer = _Xfer(op, remote_agent, time.monotonic(), None)
        self._xfers[self._next_handle] = xfer
        try:
            xfer.handle = self._agent.initialize_xfer(
                op.value,
                self._agent.get_xfer_descs(local_rows, local_mem),
                self._agent.get_xfer_descs(remote_rows, remote_mem),
                remote_agent,
                notif,
            )
            xfer.state = _STATES[self._agent.transfer(xfer.handle)]
        except _NIXL_ERRORS as e:
            logger.warning("NIXL %s with %s failed to start: %s", op.value, remote_agent, e)
            xfer.state = XferState.ERROR
        return self._next_handle

    def check_state(self, handle: int) -> XferState:
        xfer = self._xfer(handle)
        if xfer.state is not XferState.PENDING or xfer.handle is None:
            return xfer.state
        try:
            xfer.state = _STATES[self._agent.check_xfer_state(xfer.handle)]
        except _NIXL_ERRORS as e:
            logger.warning(
                "NIXL %s %d with %s failed: %s", xfer.op.value, handle, xfer.remote_agent, e
            )
            xfer.state = XferState.ERROR
        if xfer.state is XferState.PENDING and time.monotonic() - xfer.started > self.timeout_s:
            logger.warning(
                "NIXL %s %d with %s timed out after %.1f s",
                xfer.op.value,
                handle,
                xfer.remote_agent,
                self.timeout_s,
            )
            xfer.state = XferState.ERROR
        return xfer.state

    def release(self, handle: int) -> None:
        xfer = self._xfers.pop(handle, None)
        if xfer is None or xfer.handle is None:
            return
        try:
            self._agent.release_xfer_handle(xfer.handle)
        except _NIXL_ERRORS as e:
            # nixl_xfer_handle.__del__ retries; the agent frees what is left when it goes.
            logger.warning("NIXL could not release %s %d: %s", xfer.op.value, handle, e)

    def send_notif(self, remote_agent: str, msg: bytes) -> None:
        if remote_agent not in self._peers:
            raise ValueError(f"unknown agent {remote_agent!r}; add_remote_agent it first.")
        try:
            self._agent.send_notif(remote_agent, msg)
        except _NIXL_ERRORS as e:
            logger.warning("NIXL notification to %s failed: %s", remote_agent, e)

    def get_new_notifs(self) -> list[tuple[str, bytes]]:
        notifs = self._agent.get_new_notifs()
        return [(agent, msg) for agent, msgs in notifs.items() for msg in msgs]

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for handle in list(self._xfers):
            self.release(handle)
        for name in list(self._peers):
            self.remove_remote_agent(name)
        for reg in self._regs:
            self._agent.deregister_memory(reg)
        self._regs.clear()
        del self._agent

    def _xfer(self, handle: int) -> _Xfer:
        xfer = self._xfers.get(handle)
        if xfer is None:
            raise ValueError(f"unknown transfer handle {handle}.")
        return xfer
