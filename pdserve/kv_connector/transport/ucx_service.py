"""The UCX transport's service thread: every UCX call of one transport, and the READ and WRITE
protocols.

It sleeps in epoll on the worker's event fd and on an eventfd `submit` writes to: an idle
transport uses no CPU. With UCX error handling off nothing reports a dead peer, so a request
batch (a read, an answer, a control message) stuck for `timeout_s` marks its peer failed.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import select
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import numpy as np
import torch

from pdserve.kv_connector.transport import ucx_messages as wire
from pdserve.kv_connector.transport.base import Desc, XferState, check_descs

_ucx_env_before = {key for key in os.environ if key.startswith("UCX_")}
import ucxx._lib.libucxx as ucx_api  # noqa: E402
from ucxx._lib.arr import Array  # noqa: E402

# Importing ucxx exports UCX_* defaults meant for GPU buffers (RNDV_THRESH=8192 among them).
# They would reach NIXL's UCX in this process and in every child process, and make its READs
# 2-3x slower; the context gets what it needs from its own config instead.
for _key in [k for k in os.environ if k.startswith("UCX_") and k not in _ucx_env_before]:
    del os.environ[_key]

logger = logging.getLogger(__name__)

_CTRL = ucx_api.UCXXTag(wire.CTRL_TAG)


@dataclass
class Peer:
    metadata: wire.UcxAgentMetadata
    ep: ucx_api.UCXEndpoint | None = None  # set on the service thread
    failed: bool = False


@dataclass
class Xfer:
    peer: Peer
    state: XferState = XferState.PENDING


@dataclass
class _Write:
    """A WRITE waiting for its target's WriteReady, then its WriteDone."""

    xfer: Xfer
    local: list[Desc]
    last_progress: float


@dataclass
class Shared:
    """What the API methods and the service thread both touch; `lock` guards peers and notifs."""

    # uint8 views of the regions: numpy arrays of host memory, tensors of CUDA memory.
    views: list[np.ndarray | torch.Tensor] = field(default_factory=list)
    peers: dict[str, Peer] = field(default_factory=dict)
    xfers: dict[int, Xfer] = field(default_factory=dict)
    # Ids that data tags carry, unique on this worker: read handles, write handles (which the
    # writer's WriteRequest names) and the receive ids of WRITEs into this agent.
    ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    notifs: list[tuple[str, bytes]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def adopt(self, md: wire.UcxAgentMetadata) -> tuple[Peer, Peer | None] | None:
        """Record a peer; returns (new peer, the one it replaces) when it needs connecting."""
        with self.lock:
            known = self.peers.get(md.name)
            if known is not None and known.metadata.address == md.address:
                known.metadata = md  # the same process, maybe with more regions
                return None
            peer = self.peers[md.name] = Peer(md)
        return peer, known

    def notify(self, sender: str, msg: bytes) -> None:
        with self.lock:
            self.notifs.append((sender, msg))


@dataclass
class _Batch:
    """UCX requests that succeed or fail together."""

    peer: Peer
    reqs: list[ucx_api.UCXRequest]
    keep: object  # a buffer the requests point into, alive until they complete
    last_progress: float
    on_done: Callable[[], None] | None = None
    done: int = 0  # reqs[:done] completed successfully

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


class Service:
    def __init__(self, name: str, shared: Shared, config: dict[str, str], timeout_s: float) -> None:
        self.name, self.shared, self.timeout_s = name, shared, timeout_s
        self._context = ucx_api.UCXContext(config, (ucx_api.Feature.TAG, ucx_api.Feature.WAKEUP))
        self._worker = ucx_api.UCXWorker(self._context)
        self._worker.init_blocking_progress_mode()
        self.address = self._worker.address.tobytes()
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._epoll = select.epoll()
        self._epoll.register(self._worker.epoll_file_descriptor, select.EPOLLIN)
        self._epoll.register(self._wake, select.EPOLLIN)
        self._commands: deque[Callable[[], None]] = deque()
        self._batches: list[_Batch] = []
        self._writes: dict[int, _Write] = {}
        self._inbox: deque[tuple[ucx_api.UCXRequest, np.ndarray]] = deque()
        self._closed_eps: list[ucx_api.UCXEndpoint] = []  # freeing one may wait on its peer
        self._stopping = False
        self._thread = threading.Thread(target=self._serve, name=f"ucx-{name}", daemon=True)
        self._thread.start()

    def submit(self, command: Callable[[], None]) -> bool:
        """Run `command` on the service thread; False when that thread died."""
        if self._stopping:
            raise RuntimeError(f"transport {self.name!r} is shut down.")
        if not self._thread.is_alive():
            logger.error("UCX service thread of %s is gone; command dropped", self.name)
            return False
        self._commands.append(command)
        os.eventfd_write(self._wake, 1)
        return True

    def stop(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        os.eventfd_write(self._wake, 1)
        self._thread.join(timeout=10)
        if self._thread.is_alive():
            logger.error("UCX service thread of %s did not stop", self.name)
            return
        self._epoll.close()
        os.close(self._wake)

    def _serve(self) -> None:
        try:
            while not self._stopping:
                while self._commands:
                    self._commands.popleft()()
                self._worker.progress()
                self._receive()
                self._poll_batches(time.monotonic())
                if self._commands or self._inbox or not self._worker.arm():
                    continue  # more work already waiting: no sleep
                # Idle, sleep until woken; with requests in flight, wake every 10 ms as well, so
                # timeouts are checked and a missed UCX event costs milliseconds, not timeout_s.
                wait = 0.01 if self._batches or self._writes else None
                if self._epoll.poll(wait):
                    try:
                        os.eventfd_read(self._wake)
                    except BlockingIOError:
                        pass  # woken by UCX, not by a command
        except Exception:
            # No silent death: every waiter learns its transfer failed.
            logger.exception("UCX service thread of %s died", self.name)
        finally:
            for xfer in list(self.shared.xfers.values()):
                if xfer.state is XferState.PENDING:
                    xfer.state = XferState.ERROR
            for peer in list(self.shared.peers.values()):
                self._close(peer)
            self._batches.clear()
            self._inbox.clear()
            self._closed_eps.clear()
            del self._worker, self._context

    # -- commands (service thread) ------------------------------------------------------

    def use_cuda_device(self, device_index: int) -> None:
        """UCX's CUDA transports work in the calling thread's current CUDA context (ucxx's own
        progress thread sets one too): this thread makes the device's context current."""
        torch.cuda.set_device(device_index)

    def connect(self, peer: Peer, replaced: Peer | None, hello: bytes | None) -> None:
        if replaced is not None:  # a new address under a known name: the peer restarted
            self.fail_peer(replaced, "restarted")
        try:
            address = ucx_api.UCXAddress.create_from_buffer(peer.metadata.address)
            # Error handling off keeps UCX on shared memory (on, it picks TCP).
            peer.ep = self._worker.create_endpoint_from_worker_address(address, False)
        except ucx_api.UCXError as e:
            logger.warning("cannot reach agent %s: %s", peer.metadata.name, e)
            peer.failed = True
            return
        if hello is not None:
            self.send_ctrl(peer, hello)

    def start_read(
        self, handle: int, rd: Xfer, local: list[Desc], remote: list[Desc], notif: bytes
    ) -> None:
        peer = rd.peer
        if peer.failed or peer.ep is None:
            rd.state = XferState.ERROR
            return
        request = wire.encode(wire.ReadRequest(self.name, handle, remote, notif))
        try:
            # Receives first: the owner's sends then land in place, never as unexpected messages.
            reqs = self._post(peer.ep.tag_recv, local, handle)
            reqs.append(peer.ep.tag_send(Array(np.frombuffer(request, np.uint8)), _CTRL))
        except ucx_api.UCXError as e:
            logger.warning("READ %d from %s failed to start: %s", handle, peer.metadata.name, e)
            rd.state = XferState.ERROR
            return
        finish = functools.partial(setattr, rd, "state", XferState.DONE)
        self._batches.append(_Batch(peer, reqs, request, time.monotonic(), finish))

    def start_write(
        self, handle: int, xfer: Xfer, local: list[Desc], remote: list[Desc], notif: bytes
    ) -> None:
        """Offer the target the write; the data follows its WriteReady."""
        peer = xfer.peer
        if peer.failed or peer.ep is None:
            xfer.state = XferState.ERROR
            return
        self._writes[handle] = _Write(xfer, local, time.monotonic())
        self.send_ctrl(peer, wire.encode(wire.WriteRequest(self.name, handle, remote, notif)))

    def send_ctrl(self, peer: Peer, msg: bytes) -> None:
        if peer.failed or peer.ep is None:
            logger.warning("message to unreachable agent %s dropped", peer.metadata.name)
            return
        req = peer.ep.tag_send(Array(np.frombuffer(msg, np.uint8)), _CTRL)
        self._batches.append(_Batch(peer, [req], msg, time.monotonic()))

    def fail_peer(self, peer: Peer, why: str) -> None:
        """A peer that stopped answering is presumed dead: end everything in flight with it."""
        if peer.failed:
            return
        logger.warning("agent %s failed (%s)", peer.metadata.name, why)
        peer.failed = True
        for xfer in list(self.shared.xfers.values()):
            if xfer.peer is peer and xfer.state is XferState.PENDING:
                xfer.state = XferState.ERROR
        for handle in [h for h, w in self._writes.items() if w.xfer.peer is peer]:
            del self._writes[handle]
        self._close(peer)

    # -- internals (service thread) -----------------------------------------------------

    def _answer(self, req: wire.ReadRequest) -> None:
        peer = self.shared.peers.get(req.sender)
        if peer is None or peer.ep is None or peer.failed:
            logger.warning("READ request from unknown or failed agent %r dropped", req.sender)
            return
        sizes = [v.nbytes for v in self.shared.views]
        try:
            check_descs(req.descs, req.descs, sizes, sizes)
            wire.check_count(len(req.descs))
            reqs = self._post(peer.ep.tag_send, req.descs, req.handle)
        except (ValueError, AssertionError, ucx_api.UCXError) as e:
            logger.warning("READ request %d from %s dropped: %s", req.handle, req.sender, e)
            return
        notify = functools.partial(self.shared.notify, req.sender, req.notif)
        self._batches.append(_Batch(peer, reqs, None, time.monotonic(), notify))

    def _accept_write(self, req: wire.WriteRequest) -> None:
        """Post the receives of a peer's WRITE into this agent's memory, then say so."""
        peer = self.shared.peers.get(req.sender)
        if peer is None or peer.ep is None or peer.failed:
            logger.warning("WRITE request from unknown or failed agent %r dropped", req.sender)
            return
        sizes = [v.nbytes for v in self.shared.views]
        recv_id = next(self.shared.ids)
        try:
            check_descs(req.descs, req.descs, sizes, sizes)
            wire.check_count(len(req.descs))
            reqs = self._post(peer.ep.tag_recv, req.descs, recv_id)
        except (ValueError, AssertionError, ucx_api.UCXError) as e:
            logger.warning("WRITE request %d from %s refused: %s", req.handle, req.sender, e)
            self.send_ctrl(peer, wire.encode(wire.WriteReady(req.handle, 0)))
            return

        def landed() -> None:
            if req.notif:
                self.shared.notify(req.sender, req.notif)
            self.send_ctrl(peer, wire.encode(wire.WriteDone(req.handle)))

        self._batches.append(_Batch(peer, reqs, None, time.monotonic(), landed))
        self.send_ctrl(peer, wire.encode(wire.WriteReady(req.handle, recv_id)))

    def _send_write(self, ready: wire.WriteReady) -> None:
        write = self._writes.get(ready.handle)
        if write is None:  # its peer failed meanwhile: nothing is sent
            return
        peer = write.xfer.peer
        if ready.recv_id == 0 or peer.ep is None:
            del self._writes[ready.handle]
            write.xfer.state = XferState.ERROR
            return
        try:
            reqs = self._post(peer.ep.tag_send, write.local, ready.recv_id)
        except ucx_api.UCXError as e:
            logger.warning(
                "WRITE %d to %s failed to start: %s", ready.handle, peer.metadata.name, e
            )
            del self._writes[ready.handle]
            write.xfer.state = XferState.ERROR
            return
        write.last_progress = time.monotonic()
        self._batches.append(_Batch(peer, reqs, None, write.last_progress))

    def _write_done(self, done: wire.WriteDone) -> None:
        write = self._writes.pop(done.handle, None)
        if write is not None and write.xfer.state is XferState.PENDING:
            write.xfer.state = XferState.DONE

    def _receive(self) -> None:
        """Take control messages off the wire in arrival order, and handle the complete ones."""
        while (probe := self._worker.tag_probe(_CTRL, remove=True)).matched:
            buf = np.empty(probe.length, np.uint8)
            self._inbox.append((self._worker.tag_recv_with_handle(Array(buf), probe), buf))
        while self._inbox and self._inbox[0][0].completed:
            req, buf = self._inbox.popleft()
            try:
                if req.status != 0:
                    raise ValueError(f"receive failed with status {req.status}")
                msg = wire.decode_message(buf.data)
                hello = wire.decode_metadata(msg.metadata) if isinstance(msg, wire.Hello) else None
            except (ValueError, msgspec.DecodeError) as e:
                logger.warning("malformed control message dropped (%d bytes): %s", len(buf), e)
                continue
            if isinstance(msg, wire.ReadRequest):
                self._answer(msg)
            elif isinstance(msg, wire.WriteRequest):
                self._accept_write(msg)
            elif isinstance(msg, wire.WriteReady):
                self._send_write(msg)
            elif isinstance(msg, wire.WriteDone):
                self._write_done(msg)
            elif isinstance(msg, wire.Notif):
                self.shared.notify(msg.sender, msg.msg)
            elif hello is not None and (adopted := self.shared.adopt(hello)) is not None:
                self.connect(*adopted, None)

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
                self.fail_peer(batch.peer, "requests failed or timed out")
        self._batches = [b for b in pending if not b.peer.failed]
        for write in list(self._writes.values()):
            # A target that never answers (its sends are batches, timed above) fails as a peer.
            if now - write.last_progress > self.timeout_s:
                self.fail_peer(write.xfer.peer, "a WRITE got no answer")

    def _close(self, peer: Peer) -> None:
        # close() cancels the receives no bytes matched yet; it does not wait for the peer.
        if peer.ep is not None:
            peer.ep.close()
            self._closed_eps.append(peer.ep)
            peer.ep = None

    def _post(
        self,
        op: Callable[[Array, ucx_api.UCXXTag], ucx_api.UCXRequest],
        descs: list[Desc],
        handle: int,
    ) -> list[ucx_api.UCXRequest]:
        """One tag operation per descriptor, straight on registered memory: the hot loop."""
        views, tag, base = self.shared.views, ucx_api.UCXXTag, wire.data_tag(handle, 0)
        return [
            op(Array(views[d.region][d.offset : d.offset + d.length]), tag(base | i))
            for i, d in enumerate(descs)
        ]
