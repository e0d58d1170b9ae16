"""Transport over UCX tag messages (ucxx): the owner of the memory answers READ requests.

ucxx has no one-sided get, so a read is a conversation: the reader posts one receive per
descriptor straight into its registered memory, then sends a ReadRequest; the owner's service
thread sends each requested range straight from its registered memory and, once every send has
completed, records the reader's notif for its own get_new_notifs().

All UCX calls happen on one daemon service thread per transport, which sleeps in epoll on the
worker's event fd and an eventfd the API methods write to, so an idle transport uses no CPU.
"""

from __future__ import annotations

import itertools
import logging
import os
import select
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

# ucxx sets UCX_MEMTYPE_CACHE, which the bundled UCX no longer knows: without this every
# process prints an "unused environment variable" warning.
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

import msgspec  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import ucxx._lib.libucxx as ucx_api  # noqa: E402
from ucxx._lib.arr import Array  # noqa: E402

from pdserve.kv_connector.transport import ucx_messages as wire  # noqa: E402
from pdserve.kv_connector.transport.base import Desc, Transport, XferState, check_descs  # noqa: E402

logger = logging.getLogger(__name__)

# Shared memory only, and no CMA: with error handling off (which the shared-memory transports
# need), a peer killed during a CMA copy makes UCX abort the surviving process; with error
# handling on, UCX falls back to TCP at a quarter of the speed. posix moves large messages
# through shared memory as fast as CMA here, and a dead peer just stops answering.
DEFAULT_TLS = "self,posix"


@dataclass
class _Peer:
    metadata: wire.UcxAgentMetadata
    ep: ucx_api.UCXEndpoint | None = None  # set on the service thread
    failed: bool = False


@dataclass
class _Batch:
    """UCX requests that succeed or fail together: a read, an answer or one control message."""

    peer: _Peer
    reqs: list[ucx_api.UCXRequest]
    keep: object  # buffer the requests point into, alive until they complete
    last_progress: float
    done: int = 0  # requests[:done] completed successfully
    on_done: Callable[[], None] | None = None
    state: XferState = XferState.PENDING

    def poll(self, now: float, timeout_s: float) -> XferState:
        start = self.done
        while self.done < len(self.reqs) and self.reqs[self.done].completed:
            if self.reqs[self.done].status != 0:
                return XferState.ERROR
            self.done += 1
        if self.done == len(self.reqs):
            return XferState.DONE
        if self.done > start:
            self.last_progress = now
        return XferState.ERROR if now - self.last_progress > timeout_s else XferState.PENDING


@dataclass
class _Read:
    peer: _Peer
    state: XferState = XferState.PENDING


class UcxTransport(Transport):
    name = "ucx"

    def __init__(
        self, agent_name: str, host: str = "127.0.0.1", timeout_s: float = 10.0, tls: str = DEFAULT_TLS
    ) -> None:
        super().__init__(agent_name, host, timeout_s)
        # Peers are reached through the worker address in the metadata; `host` is unused.
        self._context = ucx_api.UCXContext({"TLS": tls}, (ucx_api.Feature.TAG, ucx_api.Feature.WAKEUP))
        self._worker = ucx_api.UCXWorker(self._context)
        self._worker.init_blocking_progress_mode()
        self._address = self._worker.address.tobytes()
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._epoll = select.epoll()
        self._epoll.register(self._worker.epoll_file_descriptor, select.EPOLLIN)
        self._epoll.register(self._wake, select.EPOLLIN)
        self._views: list[np.ndarray] = []
        self._lock = threading.Lock()
        self._peers: dict[str, _Peer] = {}
        self._reads: dict[int, _Read] = {}
        self._notifs: list[tuple[str, bytes]] = []
        self._ids = itertools.count(1)
        self._commands: deque[Callable[[], None]] = deque()
        # Service-thread state.
        self._batches: list[_Batch] = []
        self._inbox: deque[tuple[ucx_api.UCXRequest, np.ndarray]] = deque()
        self._closed_eps: list[ucx_api.UCXEndpoint] = []  # a dropped endpoint may block closing
        self._stopping = False
        self._thread = threading.Thread(target=self._serve, name=f"ucx-{agent_name}", daemon=True)
        self._thread.start()

    # -- API (any thread) ---------------------------------------------------------------

    def register_region(self, tensor: torch.Tensor) -> int:
        region = self._add_region(tensor)
        self._views.append(tensor.detach().reshape(-1).view(torch.uint8).numpy())
        return region

    def get_agent_metadata(self) -> bytes:
        md = wire.UcxAgentMetadata(self.agent_name, self._address, self._region_sizes())
        return wire.encode(md)

    def add_remote_agent(self, metadata: bytes) -> str:
        md = wire.decode_metadata(metadata)
        adopted = self._adopt(md)
        if adopted is not None:
            hello = wire.encode(wire.Hello(self.get_agent_metadata()))
            self._submit(lambda: self._connect(*adopted, hello))
        return md.name

    def remove_remote_agent(self, agent_name: str) -> None:
        with self._lock:
            peer = self._peers.pop(agent_name, None)
        if peer is not None:
            self._submit(lambda: self._fail_peer(peer, "removed"))

    def read(self, remote_agent: str, local: list[Desc], remote: list[Desc], notif: bytes) -> int:
        peer = self._peer(remote_agent)
        check_descs(local, remote, self._region_sizes(), peer.metadata.region_sizes)
        if len(local) >= 1 << wire.INDEX_BITS:
            raise ValueError(f"{len(local)} descriptors in one read; at most {(1 << wire.INDEX_BITS) - 1}.")
        handle = next(self._ids)
        rd = _Read(peer)
        self._reads[handle] = rd
        self._submit(lambda: self._start_read(handle, rd, local, remote, notif))
        return handle

    def check_state(self, handle: int) -> XferState:
        rd = self._reads.get(handle)
        if rd is None:
            raise ValueError(f"unknown transfer handle {handle}.")
        return rd.state

    def release(self, handle: int) -> None:
        # A pending read stays tracked by the service thread until its requests finish.
        self._reads.pop(handle, None)

    def send_notif(self, remote_agent: str, msg: bytes) -> None:
        peer = self._peer(remote_agent)
        buf = wire.encode(wire.Notif(self.agent_name, msg))
        self._submit(lambda: self._send_ctrl(peer, buf))

    def get_new_notifs(self) -> list[tuple[str, bytes]]:
        with self._lock:
            notifs, self._notifs = self._notifs, []
        return notifs

    def shutdown(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        os.eventfd_write(self._wake, 1)
        self._thread.join(timeout=10)
        if self._thread.is_alive():
            logger.error("UCX service thread of %s did not stop", self.agent_name)
            return
        self._epoll.close()
        os.close(self._wake)

    def _peer(self, name: str) -> _Peer:
        peer = self._peers.get(name)
        if peer is None:
            raise ValueError(f"unknown agent {name!r}; add_remote_agent it first.")
        return peer

    def _submit(self, command: Callable[[], None]) -> None:
        if self._stopping:
            raise RuntimeError(f"transport {self.agent_name!r} is shut down.")
        self._commands.append(command)
        os.eventfd_write(self._wake, 1)

    # -- service thread -----------------------------------------------------------------

    def _serve(self) -> None:
        try:
            while not self._stopping:
                while self._commands:
                    self._commands.popleft()()
                self._worker.progress()
                self._receive()
                now = time.monotonic()
                self._poll_batches(now)
                if self._commands or self._inbox or not self._worker.arm():
                    continue  # more work already waiting: no sleep
                deadlines = [b.last_progress + self.timeout_s for b in self._batches]
                wait = max(0.0, min(deadlines) - now) + 0.01 if deadlines else None
                if self._epoll.poll(wait):
                    try:
                        os.eventfd_read(self._wake)
                    except BlockingIOError:
                        pass  # woken by UCX, not by a command
        except Exception:
            # The process boundary rule: no silent death; every waiter learns it failed.
            logger.exception("UCX service thread of %s died", self.agent_name)
        finally:
            for rd in list(self._reads.values()):
                if rd.state is XferState.PENDING:
                    rd.state = XferState.ERROR
            self._teardown()

    def _teardown(self) -> None:
        for peer in list(self._peers.values()):
            self._close(peer)
        self._batches.clear()
        self._inbox.clear()
        self._closed_eps.clear()
        del self._worker, self._context

    def _adopt(self, md: wire.UcxAgentMetadata) -> tuple[_Peer, _Peer | None] | None:
        """Record a peer; returns (new peer, the one it replaces) when it needs connecting."""
        with self._lock:
            known = self._peers.get(md.name)
            if known is not None and known.metadata.address == md.address:
                known.metadata = md  # the same process, maybe with more regions
                return None
            peer = self._peers[md.name] = _Peer(md)
        return peer, known

    def _connect(self, peer: _Peer, replaced: _Peer | None, hello: bytes | None) -> None:
        if replaced is not None:  # a new address under a known name: the peer restarted
            self._fail_peer(replaced, "restarted")
        try:
            address = ucx_api.UCXAddress.create_from_buffer(peer.metadata.address)
            peer.ep = self._worker.create_endpoint_from_worker_address(address, False)
        except ucx_api.UCXError as e:
            logger.warning("cannot reach agent %s: %s", peer.metadata.name, e)
            peer.failed = True
            return
        if hello is not None:
            self._send_ctrl(peer, hello)

    def _start_read(self, handle: int, rd: _Read, local: list[Desc], remote: list[Desc], notif: bytes) -> None:
        peer = rd.peer
        if peer.failed or peer.ep is None:
            rd.state = XferState.ERROR
            return
        request = wire.encode(wire.ReadRequest(self.agent_name, handle, remote, notif))
        try:
            reqs = [
                peer.ep.tag_recv(self._slice(d), ucx_api.UCXXTag(wire.data_tag(handle, i)))
                for i, d in enumerate(local)
            ]
            # Receives first: the owner's sends then land in place, never as unexpected messages.
            reqs.append(peer.ep.tag_send(Array(np.frombuffer(request, np.uint8)), ucx_api.UCXXTag(wire.CTRL_TAG)))
        except ucx_api.UCXError as e:
            logger.warning("READ %d from %s failed to start: %s", handle, peer.metadata.name, e)
            rd.state = XferState.ERROR
            return

        def finish() -> None:
            rd.state = XferState.DONE

        self._batches.append(_Batch(peer, reqs, request, time.monotonic(), on_done=finish))

    def _answer(self, req: wire.ReadRequest) -> None:
        peer = self._peers.get(req.sender)
        if peer is None or peer.ep is None or peer.failed:
            logger.warning("READ request from unknown or failed agent %r dropped", req.sender)
            return
        try:
            check_descs(req.descs, req.descs, self._region_sizes(), self._region_sizes())
            reqs = [
                peer.ep.tag_send(self._slice(d), ucx_api.UCXXTag(wire.data_tag(req.handle, i)))
                for i, d in enumerate(req.descs)
            ]
        except (ValueError, AssertionError, ucx_api.UCXError) as e:
            logger.warning("READ request %d from %s dropped: %s", req.handle, req.sender, e)
            return

        def notify() -> None:
            with self._lock:
                self._notifs.append((req.sender, req.notif))

        self._batches.append(_Batch(peer, reqs, None, time.monotonic(), on_done=notify))

    def _send_ctrl(self, peer: _Peer, msg: bytes) -> None:
        if peer.failed or peer.ep is None:
            logger.warning("message to unreachable agent %s dropped", peer.metadata.name)
            return
        req = peer.ep.tag_send(Array(np.frombuffer(msg, np.uint8)), ucx_api.UCXXTag(wire.CTRL_TAG))
        self._batches.append(_Batch(peer, [req], msg, time.monotonic()))

    def _receive(self) -> None:
        """Take control messages off the wire in arrival order, and handle the complete ones."""
        while (probe := self._worker.tag_probe(ucx_api.UCXXTag(wire.CTRL_TAG), remove=True)).matched:
            buf = np.empty(probe.length, np.uint8)
            self._inbox.append((self._worker.tag_recv_with_handle(Array(buf), probe), buf))
        while self._inbox and self._inbox[0][0].completed:
            req, buf = self._inbox.popleft()
            try:
                if req.status != 0:
                    raise ValueError(f"receive failed with status {req.status}")
                msg = wire.decode_message(buf.data)
            except (ValueError, msgspec.DecodeError) as e:
                logger.warning("malformed control message dropped (%d bytes): %s", len(buf), e)
                continue
            if isinstance(msg, wire.ReadRequest):
                self._answer(msg)
            elif isinstance(msg, wire.Notif):
                with self._lock:
                    self._notifs.append((msg.sender, msg.msg))
            else:
                try:
                    adopted = self._adopt(wire.decode_metadata(msg.metadata))
                except ValueError as e:
                    logger.warning("Hello with bad metadata dropped: %s", e)
                    continue
                if adopted is not None:
                    self._connect(*adopted, None)

    def _poll_batches(self, now: float) -> None:
        pending = []
        for batch in self._batches:
            if batch.peer.failed:
                continue
            state = batch.poll(now, self.timeout_s)
            if state is XferState.PENDING:
                pending.append(batch)
            elif state is XferState.DONE:
                if batch.on_done is not None:
                    batch.on_done()
            else:
                self._fail_peer(batch.peer, "requests failed or timed out")
        self._batches = [b for b in pending if not b.peer.failed]

    def _fail_peer(self, peer: _Peer, why: str) -> None:
        """A peer that stopped answering is presumed dead: end everything in flight with it."""
        if peer.failed:
            return
        logger.warning("agent %s failed (%s)", peer.metadata.name, why)
        peer.failed = True
        for rd in list(self._reads.values()):
            if rd.peer is peer and rd.state is XferState.PENDING:
                rd.state = XferState.ERROR
        self._close(peer)

    def _close(self, peer: _Peer) -> None:
        # close() cancels the receives no bytes matched yet; it does not wait for the peer.
        if peer.ep is not None:
            peer.ep.close()
            self._closed_eps.append(peer.ep)
            peer.ep = None

    def _slice(self, d: Desc) -> Array:
        return Array(self._views[d.region][d.offset : d.offset + d.length])
