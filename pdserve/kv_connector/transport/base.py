"""The KV transport contract: register memory, exchange metadata, READ byte ranges from a peer
or WRITE them into one.

A reader pulls byte ranges of a peer's registered regions into its own; when every byte has
arrived the owner of the remote memory gets the reader's `notif`, so it knows it may free the
blocks. A writer (push mode) puts byte ranges of its own regions into a peer's; the transfer is
DONE once every byte is in the peer's memory, and the peer gets the writer's `notif` then (none
when it is empty). Failure never raises out of a transfer: a peer that dies or stops answering
turns the transfer into `XferState.ERROR` after `timeout_s`.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Sequence
from typing import Any

import msgspec
import torch

from pdserve import envs
from pdserve.config.plugins import TRANSPORTS


class XferOp(enum.Enum):
    READ = "READ"  # remote -> local
    WRITE = "WRITE"  # local -> remote


class XferState(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    ERROR = "error"


class Desc(msgspec.Struct, array_like=True, frozen=True):
    """A byte range [offset, offset + length) of registered region `region`."""

    region: int
    offset: int
    length: int


class MemoryKind(msgspec.Struct, array_like=True, frozen=True):
    """Where a region lives: host memory, or the memory of CUDA device `device_index`."""

    kind: str  # "host" | "device"
    device_index: int = 0

    def __str__(self) -> str:
        return "host" if self.kind == "host" else f"device (cuda:{self.device_index})"


HOST = MemoryKind("host")


def memory_kind(tensor: torch.Tensor) -> MemoryKind:
    if tensor.device.type == "cpu":
        return HOST
    if tensor.device.type == "cuda":
        return MemoryKind("device", tensor.device.index or 0)
    raise ValueError(f"a transport region is CPU or CUDA memory, got device {tensor.device}.")


class Transport(abc.ABC):
    """One agent: its registered regions, the peers it knows and the transfers it started.

    Register every region before `get_agent_metadata()`: the metadata carries the region table
    peers validate their descriptors against.
    """

    name: str
    # Why this agent cannot move CUDA memory; None when it can. Set by each backend.
    no_device_reason: str | None = "torch sees no CUDA device"

    def __init__(self, agent_name: str, timeout_s: float = 10.0) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}.")
        self.agent_name = agent_name
        self.timeout_s = timeout_s
        # Held so the memory outlives every transfer that may touch it.
        self._tensors: list[torch.Tensor] = []
        self._kinds: list[MemoryKind] = []

    def reaches(self, kind: MemoryKind) -> bool:
        """Whether this agent can register memory of `kind`."""
        return kind.kind == "host" or self.no_device_reason is None

    def read_obstacle(self, remote: MemoryKind) -> str | None:
        """Why a READ from a peer's `remote` memory cannot work here, None when it can. A
        one-sided READ touches the remote memory from this side, so it must reach that kind."""
        return None if self.reaches(remote) else self.no_device_reason

    def _add_region(self, tensor: torch.Tensor) -> int:
        kind = memory_kind(tensor)
        if not tensor.is_contiguous() or tensor.numel() == 0:
            raise ValueError(
                f"register_region needs a non-empty contiguous tensor, got contiguous="
                f"{tensor.is_contiguous()}, numel={tensor.numel()}."
            )
        if not self.reaches(kind):
            raise ValueError(
                f"the {self.name} transport cannot register {kind} memory: {self.no_device_reason}."
            )
        self._tensors.append(tensor)
        self._kinds.append(kind)
        return len(self._tensors) - 1

    def _region_sizes(self) -> list[int]:
        return [t.numel() * t.element_size() for t in self._tensors]

    @abc.abstractmethod
    def register_region(self, tensor: torch.Tensor) -> int:
        """Register a contiguous CPU or CUDA tensor; returns its region index (0, 1, ...)."""

    @abc.abstractmethod
    def get_agent_metadata(self) -> bytes:
        """Everything a peer needs to reach this agent and its regions."""

    @abc.abstractmethod
    def add_remote_agent(self, metadata: bytes) -> str:
        """Learn a peer from its metadata; returns its name. Same metadata again is a no-op."""

    @abc.abstractmethod
    def remove_remote_agent(self, agent_name: str) -> None:
        """Forget a peer; its transfers in flight end in ERROR."""

    @abc.abstractmethod
    def post(
        self, op: XferOp, remote_agent: str, local: list[Desc], remote: list[Desc], notif: bytes
    ) -> int:
        """Start moving remote[i] <-> local[i] for every i, in `op`'s direction; returns the
        transfer's handle. The owner of the remote memory gets `notif` once all bytes moved."""

    def read(self, remote_agent: str, local: list[Desc], remote: list[Desc], notif: bytes) -> int:
        """READ remote[i] into local[i] for every i; the owner gets `notif` once all arrived."""
        return self.post(XferOp.READ, remote_agent, local, remote, notif)

    def write(self, remote_agent: str, local: list[Desc], remote: list[Desc], notif: bytes) -> int:
        """WRITE local[i] into the peer's remote[i] for every i; DONE once all landed there."""
        return self.post(XferOp.WRITE, remote_agent, local, remote, notif)

    @abc.abstractmethod
    def check_state(self, handle: int) -> XferState:
        """Non-blocking state of a transfer started by `post`."""

    @abc.abstractmethod
    def release(self, handle: int) -> None:
        """Forget a finished transfer (DONE or ERROR)."""

    @abc.abstractmethod
    def send_notif(self, remote_agent: str, msg: bytes) -> None:
        """Send a small message to a peer; it shows up in the peer's `get_new_notifs()`."""

    @abc.abstractmethod
    def get_new_notifs(self) -> list[tuple[str, bytes]]:
        """(sender agent name, message) received since the last call."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Release every resource; safe to call twice."""


def check_descs(
    local: Sequence[Desc], remote: Sequence[Desc], local_sizes: list[int], remote_sizes: list[int]
) -> None:
    """ValueError unless local[i] and remote[i] are equal-length ranges inside their regions."""
    if not local:
        raise ValueError(
            "a transfer needs at least one descriptor (send_notif carries a bare message)."
        )
    if len(local) != len(remote):
        raise ValueError(f"{len(local)} local descriptors but {len(remote)} remote ones.")
    for i, (ld, rd) in enumerate(zip(local, remote)):
        if ld.length != rd.length:
            raise ValueError(f"descriptor {i}: local length {ld.length} != remote {rd.length}.")
        for side, d, sizes in (("local", ld, local_sizes), ("remote", rd, remote_sizes)):
            if not 0 <= d.region < len(sizes):
                raise ValueError(f"descriptor {i}: {side} region {d.region} of {len(sizes)}.")
            if d.length <= 0 or d.offset < 0 or d.offset + d.length > sizes[d.region]:
                raise ValueError(
                    f"descriptor {i}: {side} range [{d.offset}, {d.offset + d.length}) outside "
                    f"region {d.region} of {sizes[d.region]} bytes."
                )


def block_descs(
    local_region: int,
    local_block_ids: Sequence[int],
    remote_region: int,
    remote_block_ids: Sequence[int],
    block_len: int,
) -> tuple[list[Desc], list[Desc]]:
    """Pair local block i with remote block i, one descriptor per run consecutive on both sides."""
    if len(local_block_ids) != len(remote_block_ids):
        raise ValueError(
            f"{len(local_block_ids)} local blocks but {len(remote_block_ids)} remote blocks."
        )
    if block_len <= 0:
        raise ValueError(f"block_len must be positive, got {block_len}.")
    local: list[Desc] = []
    remote: list[Desc] = []
    n = len(local_block_ids)
    start = 0
    while start < n:
        end = start + 1
        while (
            end < n
            and local_block_ids[end] == local_block_ids[end - 1] + 1
            and remote_block_ids[end] == remote_block_ids[end - 1] + 1
        ):
            end += 1
        length = (end - start) * block_len
        local.append(Desc(local_region, local_block_ids[start] * block_len, length))
        remote.append(Desc(remote_region, remote_block_ids[start] * block_len, length))
        start = end
    return local, remote


BACKENDS = TRANSPORTS.supported_names()
# The package that brings each backend's library, for the error when it cannot be imported.
_INSTALL_HINTS = {"nixl": "pip install nixl-cu12==1.5.1", "ucx": "pip install ucxx-cu12==0.52.0"}
# The ucx backend's shared-memory defaults plus UCX's CUDA copy and IPC transports.
CUDA_TLS = "self,posix,cuda_copy,cuda_ipc"


def make_transport(
    name: str,
    agent_name: str,
    timeout_s: float = 10.0,
    ucx_tls: str | None = None,
    device_memory: bool = False,
) -> Transport:
    """The transport `name` (one of BACKENDS); its library is imported only when chosen.

    `ucx_tls` overrides the ucx backend's UCX transports (e.g. "self,posix,tcp" between hosts);
    `device_memory`: CUDA regions will be registered (the ucx backend adds UCX's CUDA
    transports to its defaults). Where PDSERVE_KV_FAULT_PLAN is set (tests), the transport comes
    wrapped in the fault-injecting one.
    """
    try:
        cls = TRANSPORTS.get(name)
    except ImportError as e:
        raise RuntimeError(
            f"transport {name!r} cannot import its library ({e}); {_INSTALL_HINTS[name]}"
        ) from e
    kwargs: dict[str, Any] = {}
    if name == "ucx":
        tls = ucx_tls or (CUDA_TLS if device_memory else None)
        kwargs["ucx_config"] = {"TLS": tls} if tls else None
    transport = cls(agent_name, timeout_s, **kwargs)
    plan = envs.kv_fault_plan()
    if plan is None:
        return transport
    from pdserve.kv_connector.transport.fault import FaultTransport

    return FaultTransport(transport, plan)
