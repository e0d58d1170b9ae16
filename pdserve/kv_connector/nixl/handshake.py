"""The side channel: a prefill instance answers handshakes; a decode worker asks.

The engine core process of every instance serves, on PDSERVE_SIDE_CHANNEL_HOST:PORT, one
pre-encoded `HandshakePayload` per worker rank (ZMQ ROUTER, a daemon thread). A decode worker
asks with a REQ socket and a timeout, checks the compatibility hash before it decodes anything
else, and only then learns the remote agent.
"""

from __future__ import annotations

import logging
import threading

import msgspec
import zmq

from pdserve.kv_connector.nixl.metadata import (
    AgentMetadata,
    HandshakePayload,
    HandshakeRequest,
    compatibility_hash,
    factor_differences,
)

logger = logging.getLogger(__name__)

_POLL_MS = 500  # how often the server thread looks at its stop flag


class HandshakeError(RuntimeError):
    """The handshake failed: no answer, a malformed answer, or an incompatible peer.

    `reason` is the message without the peer's address: what a client may be told."""

    def __init__(self, where: str, reason: str) -> None:
        super().__init__(f"KV handshake with {where}: {reason}.")
        self.reason = reason


def client_reason(e: Exception) -> str:
    """A failure as a client may be told it: handshake and layout errors say what differs and
    name no address; a transport's own error (which may) only by its type."""
    if isinstance(e, HandshakeError):
        return e.reason
    if isinstance(e, ValueError):
        return str(e)
    return f"{type(e).__name__} in the transport (this instance's log has the details)"


class HandshakeServer:
    def __init__(self, host: str, port: int, payloads: dict[int, bytes]) -> None:
        self.payloads = payloads
        self.ctx = zmq.Context()
        self.socket = self.ctx.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        try:
            if port == 0:
                self.port = self.socket.bind_to_random_port(f"tcp://{host}")
            else:
                self.socket.bind(f"tcp://{host}:{port}")
                self.port = port
        except zmq.ZMQError as e:
            self.socket.close()
            self.ctx.term()
            raise RuntimeError(
                f"The KV side channel cannot listen on {host}:{port} ({e}); set "
                "PDSERVE_SIDE_CHANNEL_HOST / PDSERVE_SIDE_CHANNEL_PORT to a free address."
            ) from None
        self._stop = threading.Event()
        self._decoder = msgspec.msgpack.Decoder(HandshakeRequest)
        self._thread = threading.Thread(
            target=self._serve, name="pdserve-side-channel", daemon=True
        )
        self._thread.start()
        logger.info("KV side channel listening on %s:%d", host, self.port)

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(_POLL_MS):
                continue
            frames = self.socket.recv_multipart()
            try:
                # A REQ peer sends [identity, empty delimiter, request].
                identity, request = frames[0], frames[-1]
                tp_rank = self._decoder.decode(request).tp_rank
                payload = self.payloads[tp_rank]
            except (msgspec.DecodeError, KeyError, IndexError) as e:
                logger.warning(
                    "Dropped a malformed handshake request (%d frames): %s", len(frames), e
                )
                continue
            self.socket.send_multipart([identity, b"", payload])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2 * _POLL_MS / 1000)
        self.socket.close()
        self.ctx.term()


def fetch_agent_metadata(
    host: str,
    port: int,
    tp_rank: int,
    expected_factors: dict[str, str | int] | None,
    expected_engine_id: str,
    timeout_s: float,
) -> AgentMetadata:
    """Ask a prefill instance for one rank's metadata; raises HandshakeError on any failure.
    `expected_factors`: this instance's compatibility factors (None: the hash is not checked)."""
    ctx = zmq.Context.instance()
    socket = ctx.socket(zmq.REQ)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
    socket.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
    where = f"{host}:{port} (engine {expected_engine_id}, rank {tp_rank})"
    try:
        socket.connect(f"tcp://{host}:{port}")
        socket.send(msgspec.msgpack.encode(HandshakeRequest(tp_rank)))
        reply = socket.recv()
    except zmq.Again:
        raise HandshakeError(where, f"no answer within {timeout_s:.1f} s") from None
    except zmq.ZMQError as e:
        raise HandshakeError(where, str(e)) from None
    finally:
        socket.close()
    try:
        payload = msgspec.msgpack.decode(reply, type=HandshakePayload)
    except msgspec.DecodeError:
        raise HandshakeError(
            where, "undecodable answer (an incompatible pdserve version?)"
        ) from None
    if expected_factors is not None:
        expected_hash = compatibility_hash(expected_factors)
        if payload.compatibility_hash != expected_hash:
            differences = factor_differences(payload.compatibility_factors, expected_factors) or (
                "the two instances differ in model, dtype, KV heads, head size, layers, block "
                "size, transport or version"
            )
            raise HandshakeError(
                where,
                f"compatibility hash mismatch (prefill {payload.compatibility_hash}, decode "
                f"{expected_hash}): {differences}",
            )
    try:
        meta = msgspec.msgpack.decode(payload.agent_metadata, type=AgentMetadata)
    except msgspec.DecodeError:
        raise HandshakeError(where, "undecodable agent metadata") from None
    if meta.engine_id != expected_engine_id:
        raise HandshakeError(
            where,
            f"the instance there is engine {meta.engine_id}, not {expected_engine_id} (restarted?)",
        )
    return meta
