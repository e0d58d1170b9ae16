"""Transport over UCX tag messages (ucxx): the owner of the memory answers READ and WRITE
requests.

ucxx has no one-sided get or put, so a transfer is a conversation (see docs/transport.md).
READ: the reader posts one receive per descriptor straight into its registered memory, then
sends a ReadRequest; the owner's service thread sends each requested range straight from its
registered memory and, once every send has completed, records the reader's notif for its own
get_new_notifs(). WRITE: the writer sends a WriteRequest; the target posts the receives into its
memory and answers WriteReady with an id for their tags; the writer sends the ranges; once all
arrived the target records the notif and answers WriteDone, which makes the write DONE. All UCX
work happens on the service thread (ucx_service.py).
"""

from __future__ import annotations

from functools import partial

import torch

from pdserve.kv_connector.transport import ucx_messages as wire
from pdserve.kv_connector.transport.base import (
    Desc,
    MemoryKind,
    Transport,
    XferOp,
    XferState,
    check_descs,
)
from pdserve.kv_connector.transport.ucx_service import Peer, Service, Shared, Xfer

DEFAULT_UCX_CONFIG = {
    # Shared memory only, and no CMA: with error handling off (which the shared-memory
    # transports need), a peer killed during a CMA copy makes UCX abort the surviving process;
    # with error handling on, UCX falls back to TCP at a quarter of the speed. posix moves large
    # messages through shared memory about as fast, and a dead peer just stops answering.
    "TLS": "self,posix",
    # KV blocks of up to 64 KiB go eagerly: receives are posted before the request, and the
    # rendezvous handshake per block costs more than it saves, most of all on a busy machine.
    "RNDV_THRESH": "65536",
}


def tls_reaches_device(tls: str) -> bool:
    """Whether a UCX_TLS value enables a CUDA transport (cuda, cuda_copy, cuda_ipc, gdr_copy,
    or all); a value starting with ^ lists the transports left out."""
    names = tls.removeprefix("^").split(",")
    named = any(n == "all" or n.startswith(("cuda", "gdr")) for n in names)
    return not named if tls.startswith("^") else named


class UcxTransport(Transport):
    name = "ucx"

    def __init__(
        self,
        agent_name: str,
        timeout_s: float = 10.0,
        ucx_config: dict[str, str] | None = None,
    ) -> None:
        super().__init__(agent_name, timeout_s)
        # Peers are reached through the worker address in the metadata.
        self._shared = Shared()
        config = {**DEFAULT_UCX_CONFIG, **(ucx_config or {})}
        if not tls_reaches_device(config["TLS"]):
            self.no_device_reason = f"its UCX TLS {config['TLS']!r} has no CUDA transport"
        elif torch.cuda.is_available():
            self.no_device_reason = None
        self._service = Service(agent_name, self._shared, config, timeout_s)

    def read_obstacle(self, remote: MemoryKind) -> None:
        # The owner sends from its own memory, which it registered: a reader touches only its
        # own regions, whatever the peer's kind.
        return None

    def register_region(self, tensor: torch.Tensor) -> int:
        region = self._add_region(tensor)
        flat = tensor.detach().reshape(-1).view(torch.uint8)
        kind = self._kinds[region]
        if kind.kind == "device":
            # ucxx takes CUDA memory through __cuda_array_interface__, which a tensor has.
            self._service.submit(partial(self._service.use_cuda_device, kind.device_index))
            self._shared.views.append(flat)
        else:
            self._shared.views.append(flat.numpy())
        return region

    def get_agent_metadata(self) -> bytes:
        md = wire.UcxAgentMetadata(self.agent_name, self._service.address, self._region_sizes())
        return wire.encode(md)

    def add_remote_agent(self, metadata: bytes) -> str:
        md = wire.decode_metadata(metadata)
        adopted = self._shared.adopt(md)
        if adopted is not None:
            # The owner needs an endpoint back to this agent to answer and to notify.
            hello = wire.encode(wire.Hello(self.get_agent_metadata()))
            self._service.submit(lambda: self._service.connect(*adopted, hello))
        return md.name

    def remove_remote_agent(self, agent_name: str) -> None:
        with self._shared.lock:
            peer = self._shared.peers.pop(agent_name, None)
        if peer is not None:
            self._service.submit(lambda: self._service.fail_peer(peer, "removed"))

    def post(
        self, op: XferOp, remote_agent: str, local: list[Desc], remote: list[Desc], notif: bytes
    ) -> int:
        peer = self._peer(remote_agent)
        check_descs(local, remote, self._region_sizes(), peer.metadata.region_sizes)
        wire.check_count(len(local))
        handle = next(self._shared.ids)
        xfer = self._shared.xfers[handle] = Xfer(peer)
        starter = self._service.start_read if op is XferOp.READ else self._service.start_write
        if not self._service.submit(partial(starter, handle, xfer, local, remote, notif)):
            xfer.state = XferState.ERROR
        return handle

    def check_state(self, handle: int) -> XferState:
        xfer = self._shared.xfers.get(handle)
        if xfer is None:
            raise ValueError(f"unknown transfer handle {handle}.")
        return xfer.state

    def release(self, handle: int) -> None:
        # A pending transfer stays tracked by the service thread until its requests finish.
        self._shared.xfers.pop(handle, None)

    def send_notif(self, remote_agent: str, msg: bytes) -> None:
        peer = self._peer(remote_agent)
        buf = wire.encode(wire.Notif(self.agent_name, msg))
        self._service.submit(lambda: self._service.send_ctrl(peer, buf))

    def get_new_notifs(self) -> list[tuple[str, bytes]]:
        with self._shared.lock:
            notifs, self._shared.notifs = self._shared.notifs, []
        return notifs

    def shutdown(self) -> None:
        self._service.stop()

    def _peer(self, name: str) -> Peer:
        peer = self._shared.peers.get(name)
        if peer is None:
            raise ValueError(f"unknown agent {name!r}; add_remote_agent it first.")
        return peer
