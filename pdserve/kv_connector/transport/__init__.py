"""KV transport: READ byte ranges of a peer's registered memory, or WRITE into it; its owner gets
a notification."""

from pdserve.kv_connector.transport.base import (
    BACKENDS,
    Desc,
    Transport,
    XferOp,
    XferState,
    block_descs,
    make_transport,
)

__all__ = [
    "BACKENDS",
    "Desc",
    "Transport",
    "XferOp",
    "XferState",
    "block_descs",
    "make_transport",
]
