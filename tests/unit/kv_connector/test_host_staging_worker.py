"""Host staging, worker role, with real transports in one process: the prefill worker copies
the blocks into its host buffer after the forward pass, the decode worker READs them into its
own and copies them into its cache before it reports the load done. Both caches are CPU
tensors; on CUDA the same path runs with a device cache and pinned buffers. Also: a handshake
with a peer whose memory kind this side's transport cannot read fails, naming both kinds."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

import msgspec
import pytest
import torch

from pdserve.config import EngineConfig
from pdserve.kv_connector.nixl.handshake import HandshakeServer
from pdserve.kv_connector.nixl.metadata import (
    AgentMetadata,
    HandshakePayload,
    NixlConnectorMetadata,
    RecvReqMeta,
    SaveReqMeta,
)
from pdserve.kv_connector.nixl.worker import NixlConnectorWorker
from pdserve.kv_connector.transport.base import MemoryKind

SHAPE = (12, 2, 2, 16, 2, 8)  # blocks, layers, K/V, block size, KV heads, head size
STAGING_BLOCKS = 8


@pytest.fixture
def make_worker(model: str) -> Iterator[Callable[..., NixlConnectorWorker]]:
    made: list[NixlConnectorWorker] = []

    def make(role: str, transport: str, staged: bool) -> NixlConnectorWorker:
        extra: dict[str, object] = {"transport": transport, "handshake_timeout": 5}
        if staged:
            extra |= {"host_staging": True, "host_buffer_blocks": STAGING_BLOCKS}
        config = EngineConfig.from_engine_args(
            model=model,
            block_size=SHAPE[3],
            kv_transfer_config={
                "kv_role": role,
                "engine_id": f"{role}-{transport}",
                "kv_buffer_device": "cpu",
                "kv_connector_extra_config": extra,
            },
        )
        worker = NixlConnectorWorker(config, 0)
        made.append(worker)
        cache = torch.randn(SHAPE) if role == "kv_producer" else torch.zeros(SHAPE)
        worker.register_kv_caches(cache)
        return worker

    yield make
    for worker in made:
        worker.shutdown()


@pytest.fixture
def serve() -> Iterator[Callable[[bytes], int]]:
    servers: list[HandshakeServer] = []

    def start(payload: bytes) -> int:
        servers.append(HandshakeServer("127.0.0.1", 0, {0: payload}))
        return servers[-1].port

    yield start
    for server in servers:
        server.close()


def _recv(producer: NixlConnectorWorker, port: int, staging_ids: list[int]) -> RecvReqMeta:
    return RecvReqMeta(
        [7, 2, 9], [0, 1, 2], producer.engine_id, "p-1", "127.0.0.1", port, 1, staging_ids
    )


def _wait(done: Callable[[], bool], limit_s: float = 20.0) -> None:
    deadline = time.monotonic() + limit_s
    while not done():
        assert time.monotonic() < deadline, "transfer still in flight"
        time.sleep(0.005)


@pytest.mark.parametrize("transport", ["nixl", "ucx"])
def test_staged_blocks_arrive_token_exact(
    make_worker: Callable[..., NixlConnectorWorker],
    serve: Callable[[bytes], int],
    transport: str,
) -> None:
    producer = make_worker("kv_producer", transport, staged=True)
    consumer = make_worker("kv_consumer", transport, staged=True)
    assert producer.host_buffer is not None and consumer.host_buffer is not None
    # The step that completes the prompt: its blocks 3, 4, 5 go to staging blocks 0, 1, 2.
    producer.bind(
        NixlConnectorMetadata(
            reqs_to_send={"p-1": time.time() + 30},
            reqs_to_save={"p-1": SaveReqMeta([3, 4, 5], [0, 1, 2])},
        )
    )
    producer.start_load_kv()
    producer.wait_for_save()
    p_cache = producer.kv_cache
    assert p_cache is not None
    assert torch.equal(producer.host_buffer.tensor[:3], p_cache[3:6])
    payload = producer.get_handshake_metadata()
    agent = msgspec.msgpack.decode(
        msgspec.msgpack.decode(payload, type=HandshakePayload).agent_metadata, type=AgentMetadata
    )
    # Peers read the host buffer, not the cache.
    assert agent.num_blocks == STAGING_BLOCKS and agent.memory == MemoryKind("host")

    consumer.bind(
        NixlConnectorMetadata(reqs_to_recv={"d-1": _recv(producer, serve(payload), [4, 5, 6])})
    )
    consumer.start_load_kv()
    sent: set[str] = set()
    received: set[str] = set()

    def both_done() -> bool:
        sent.update(producer.get_finished()[0] or ())
        received.update(consumer.get_finished()[1] or ())
        return "p-1" in sent and "d-1" in received

    _wait(both_done)
    d_cache = consumer.kv_cache
    assert d_cache is not None
    assert consumer.take_invalid_block_ids() == set()
    assert torch.equal(d_cache[[7, 2, 9]], p_cache[[3, 4, 5]])
    untouched = [b for b in range(SHAPE[0]) if b not in (7, 2, 9)]
    assert not d_cache[untouched].any()
    assert consumer.take_stats()["transfers"] == 1


def test_handshake_with_unreachable_memory_names_both_kinds(
    make_worker: Callable[..., NixlConnectorWorker],
    serve: Callable[[bytes], int],
    caplog: pytest.LogCaptureFixture,
) -> None:
    if torch.cuda.is_available():
        pytest.skip("NIXL reaches device memory where CUDA is")
    producer = make_worker("kv_producer", "nixl", staged=False)
    consumer = make_worker("kv_consumer", "nixl", staged=False)
    payload = msgspec.msgpack.decode(producer.get_handshake_metadata(), type=HandshakePayload)
    agent = msgspec.msgpack.decode(payload.agent_metadata, type=AgentMetadata)
    # A prefill instance whose cache is registered as VRAM on its device 0.
    agent.memory = MemoryKind("device", 0)
    payload.agent_metadata = msgspec.msgpack.encode(agent)
    port = serve(msgspec.msgpack.encode(payload))
    consumer.bind(NixlConnectorMetadata(reqs_to_recv={"d-1": _recv(producer, port, [])}))
    with caplog.at_level(logging.ERROR):
        consumer.start_load_kv()
        _wait(lambda: "d-1" in (consumer.get_finished()[1] or ()))
    assert consumer.take_invalid_block_ids() == {7, 2, 9}
    assert consumer.take_stats() == {"handshake_failures": 1, "failed_transfers": 1}
    assert (
        "its KV memory is device (cuda:0), this instance's is host, and the nixl transport here "
        "cannot read device (cuda:0) memory (torch sees no CUDA device)"
    ) in caplog.text
