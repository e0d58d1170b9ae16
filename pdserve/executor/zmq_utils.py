"""Small ZMQ helpers shared by the executor's queues."""

from __future__ import annotations

import os
import tempfile
import uuid

import zmq


def make_ipc_address(name: str) -> str:
    """A fresh ipc:// address; libzmq removes the socket file when the bound socket closes."""
    return f"ipc://{os.path.join(tempfile.gettempdir(), f'pdserve-{name}-{uuid.uuid4().hex[:12]}')}"


def bind_socket(sock: zmq.Socket, addr: str) -> str:
    """Bind and return the address peers connect to (a tcp port of '*' is chosen here)."""
    if addr.startswith("tcp://") and addr.endswith(":*"):
        host = addr[len("tcp://") : -2]
        port = sock.bind_to_random_port(f"tcp://{host}")
        return f"tcp://{host}:{port}"
    sock.bind(addr)
    return addr
