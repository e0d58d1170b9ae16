"""What crosses between two UCX transports: agent metadata, control messages and tag layout.

Control messages travel on CTRL_TAG and are decoded with `decode_message`. Data travels on
`data_tag(id, index)`, where `id` is one the receiving side drew for the transfer (a reader's
handle; for a WRITE, the id the target answers with): ids are unique on the receiving worker, so
the bytes of concurrent transfers, from any number of peers, never match another's receive.
"""

from __future__ import annotations

import msgspec

from pdserve.kv_connector.transport.base import Desc

CTRL_TAG = 1 << 63
INDEX_BITS = 24  # descriptors per read: 16 M, far above any KV read
MAX_HANDLE = (1 << (63 - INDEX_BITS)) - 1


def check_count(num_descs: int) -> None:
    if num_descs >= 1 << INDEX_BITS:
        raise ValueError(f"{num_descs} descriptors in one read; at most {(1 << INDEX_BITS) - 1}.")


def data_tag(handle: int, index: int) -> int:
    assert 0 < handle <= MAX_HANDLE and 0 <= index < 1 << INDEX_BITS, (handle, index)
    return handle << INDEX_BITS | index


class UcxAgentMetadata(msgspec.Struct, array_like=True, frozen=True):
    name: str
    address: bytes  # the UCX worker address: endpoints from it take the shared-memory path
    region_sizes: list[int]  # bytes per region, so readers check bounds before sending


class Hello(msgspec.Struct, tag=True, array_like=True, frozen=True):
    """Sent on add_remote_agent: the owner needs an endpoint back to answer and notify."""

    metadata: bytes


class ReadRequest(msgspec.Struct, tag=True, array_like=True, frozen=True):
    """Send remote descriptor i on data_tag(handle, i); record `notif` once all are sent."""

    sender: str
    handle: int
    descs: list[Desc]
    notif: bytes


class WriteRequest(msgspec.Struct, tag=True, array_like=True, frozen=True):
    """A writer's offer: post receives for `descs` (the target's memory), answer WriteReady;
    record `notif` (when not empty) and answer WriteDone once all arrived."""

    sender: str
    handle: int  # the writer's
    descs: list[Desc]
    notif: bytes


class WriteReady(msgspec.Struct, tag=True, array_like=True, frozen=True):
    """The target's receives are posted: send descriptor i on data_tag(recv_id, i); recv_id 0:
    refused (the descriptors were bad), the write fails."""

    handle: int
    recv_id: int


class WriteDone(msgspec.Struct, tag=True, array_like=True, frozen=True):
    """Every byte of the writer's `handle` is in the target's memory."""

    handle: int


class Notif(msgspec.Struct, tag=True, array_like=True, frozen=True):
    sender: str
    msg: bytes


Message = Hello | ReadRequest | WriteRequest | WriteReady | WriteDone | Notif

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)
_metadata_decoder = msgspec.msgpack.Decoder(UcxAgentMetadata)


def encode(obj: Message | UcxAgentMetadata) -> bytes:
    return _encoder.encode(obj)


def decode_message(buf: bytes | memoryview) -> Message:
    """Raises msgspec.DecodeError (or ValidationError) on anything but a Message."""
    return _decoder.decode(buf)


def decode_metadata(buf: bytes) -> UcxAgentMetadata:
    try:
        return _metadata_decoder.decode(buf)
    except msgspec.DecodeError as e:
        raise ValueError(f"not UCX transport metadata: {e}") from e
