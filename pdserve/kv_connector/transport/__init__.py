"""KV transport: READ byte ranges of a peer's registered memory; its owner gets a notification."""

from pdserve.kv_connector.transport.base import (
    BACKENDS,
    TRANSPORTS,
    Desc,
    Transport,
    XferState,
    block_descs,
    make_transport,
)

__all__ = [
    "BACKENDS",
    "TRANSPORTS",
    "Desc",
    "Transport",
    "XferState",
    "block_descs",
    "make_transport",
]
