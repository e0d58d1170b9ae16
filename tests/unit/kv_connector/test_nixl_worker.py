"""The NixlConnector's worker role, prefill and decode worker in one process over a real
transport: READs land byte-exact and free the prefill side, empty reads only free it, leases
expire or are renewed by heartbeats, and every failure ends its request alone, counted."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest
import torch

from pdserve.config import EngineConfig
from pdserve.config.speculative import SpeculativeConfig
from pdserve.kv_connector.nixl import handshaker as nixl_handshaker
from pdserve.kv_connector.nixl import lease as nixl_lease
from pdserve.kv_connector.nixl.handshake import HandshakeServer
from pdserve.kv_connector.nixl.metadata import (
    AgentMetadata,
    HandshakePayload,
    NixlConnectorMetadata,
    RecvReqMeta,
)
from pdserve.kv_connector.nixl.worker import NixlConnectorWorker
from pdserve.kv_connector.transport.base import HOST
from tests.utils.tiny_models import make_tiny_model

from .halves import BLOCK_SHAPE, cache, kv_config, poll

pytestmark = pytest.mark.timeout(120)

NUM_BLOCKS = 12
LEASE = 30.0
transports = pytest.mark.parametrize("transport", ["nixl", "ucx"])


class Clock:
    """The workers' wall clock, moved by the test: leases expire when it says."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def time(self) -> float:
        return self.now

    def __getattr__(self, name: str) -> object:  # perf_counter, monotonic: the real ones
        import time

        return getattr(time, name)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(nixl_handshaker, "time", clock)
    monkeypatch.setattr(nixl_lease, "time", clock)
    return clock


@pytest.fixture
def make_worker(model: str) -> Iterator[Callable[..., NixlConnectorWorker]]:
    made: list[NixlConnectorWorker] = []

    def make(
        role: str,
        transport: str = "nixl",
        engine_id: str | None = None,
        kv_cache: torch.Tensor | None = None,
        tp: int = 1,
        tp_rank: int = 0,
    ) -> NixlConnectorWorker:
        engine_id = engine_id or ("prefill" if role == "kv_producer" else "decode")
        config = kv_config(model, role, engine_id, transport, tp=tp, kv_lease_duration=LEASE)
        worker = NixlConnectorWorker(config, tp_rank)
        made.append(worker)
        worker.register_kv_caches(
            kv_cache if kv_cache is not None else cache(NUM_BLOCKS, role == "kv_producer")
        )
        return worker

    yield make
    for worker in made:
        worker.shutdown()


@pytest.fixture
def serve() -> Iterator[Callable[..., int]]:
    """Serve a prefill worker's handshake payloads (rank -> bytes); returns the port."""
    servers: list[HandshakeServer] = []

    def start(*workers: NixlConnectorWorker) -> int:
        payloads = {rank: w.get_handshake_metadata() for rank, w in enumerate(workers)}
        servers.append(HandshakeServer("127.0.0.1", 0, payloads))
        return servers[-1].port

    yield start
    for server in servers:
        server.close()


def recv(
    local: list[int], remote: list[int], remote_id: str, port: int, engine: str = "prefill"
) -> RecvReqMeta:
    return RecvReqMeta(local, remote, engine, remote_id, "127.0.0.1", port, 1)


def lease(worker: NixlConnectorWorker, expiry: float, *req_ids: str) -> None:
    """The step in which the prefill worker learns that finished requests wait for a reader."""
    worker.bind(NixlConnectorMetadata(reqs_to_send={r: expiry for r in req_ids}))
    worker.start_load_kv()


def load(worker: NixlConnectorWorker, **reqs: RecvReqMeta) -> None:
    worker.bind(NixlConnectorMetadata(reqs_to_recv=reqs))
    worker.start_load_kv()


class Finished:
    """Everything a set of workers reported finished so far, as (sending, receiving)."""

    def __init__(self, *workers: NixlConnectorWorker) -> None:
        self.workers = workers
        self.sending: list[str] = []
        self.recving: list[str] = []

    def poll(self) -> Finished:
        for worker in self.workers:
            sending, recving = worker.get_finished()
            self.sending += sorted(sending or ())
            self.recving += sorted(recving or ())
        return self

    def until(self, sending: tuple[str, ...] = (), recving: tuple[str, ...] = ()) -> Finished:
        poll(lambda: set(sending) <= set(self.poll().sending) and set(recving) <= set(self.recving))
        return self


@transports
def test_read_lands_byte_exact_and_frees_the_prefill_side(
    make_worker: Callable[..., NixlConnectorWorker],
    serve: Callable[..., int],
    clock: Clock,
    transport: str,
) -> None:
    """The decode worker reads the tail of the prefill side's blocks (its local prefix hit
    covers the head) into its own, in runs of consecutive blocks; the done notification ends
    the prefill side's lease."""
    p = make_worker("kv_producer", transport)
    d = make_worker("kv_consumer", transport)
    lease(p, clock.now + LEASE, "p-1")
    load(d, **{"d-1": recv([7, 2, 3], [0, 1, 2, 3, 4], "p-1", serve(p))})
    finished = Finished(p, d).until(sending=("p-1",), recving=("d-1",))
    assert (finished.sending, finished.recving) == (["p-1"], ["d-1"])
    assert torch.equal(d.kv_cache[[7, 2, 3]], p.kv_cache[[2, 3, 4]])
    assert not d.kv_cache[[b for b in range(NUM_BLOCKS) if b not in (7, 2, 3)]].any()
    assert d.take_invalid_block_ids() == set()
    stats = d.take_stats()
    block_bytes = p.kv_cache[0].nbytes
    # (7 <- 2) and (2, 3 <- 3, 4): two runs.
    assert {k: stats[k] for k in ("transfers", "transfer_bytes", "transfer_descriptors")} == {
        "transfers": 1,
        "transfer_bytes": 3 * block_bytes,
        "transfer_descriptors": 2,
    }
    # Nothing more: each end is reported once.
    assert Finished(p, d).poll().sending == [] and Finished(p, d).poll().recving == []


@transports
def test_empty_read_only_tells_the_prefill_side_to_free(
    make_worker: Callable[..., NixlConnectorWorker],
    serve: Callable[..., int],
    clock: Clock,
    transport: str,
) -> None:
    """No local block to fill (aborted before admission, or nothing to read): the decode
    worker handshakes, sends `done` and reports the load ended; nothing is written."""
    p = make_worker("kv_producer", transport)
    d = make_worker("kv_consumer", transport)
    lease(p, clock.now + LEASE, "p-1")
    load(d, **{"d-1": recv([], [0, 1, 2], "p-1", serve(p))})
    Finished(p, d).until(sending=("p-1",), recving=("d-1",))
    assert not d.kv_cache.any() and d.take_invalid_block_ids() == set()
    assert "transfers" not in d.take_stats()


def test_lease_expires_unread(
    make_worker: Callable[..., NixlConnectorWorker], clock: Clock
) -> None:
    p = make_worker("kv_producer")
    lease(p, clock.now + LEASE, "p-1")
    clock.now += LEASE - 1
    assert p.get_finished() == (None, None)
    clock.now += 2
    assert p.get_finished() == ({"p-1"}, None)
    assert p.take_stats() == {"expired_leases": 1}
    assert p.get_finished() == (None, None)


@transports
def test_heartbeats_renew_a_lease(
    make_worker: Callable[..., NixlConnectorWorker],
    serve: Callable[..., int],
    clock: Clock,
    transport: str,
) -> None:
    """A decode worker's heartbeat for a request it will read later keeps the prefill side's
    blocks for two thirds of a lease from when it arrived."""
    p = make_worker("kv_producer", transport)
    d = make_worker("kv_consumer", transport)
    port = serve(p)
    start = clock.now
    lease(p, start + LEASE, "p-1", "p-2", "p-3")
    load(d, **{"d-1": recv([], [0], "p-1", port)})  # the handshake
    Finished(p, d).until(sending=("p-1",), recving=("d-1",))
    clock.now = start + LEASE - 5
    # The heartbeat goes first; the empty read's notification after it marks its arrival.
    d.bind(
        NixlConnectorMetadata(
            reqs_to_recv={"d-3": recv([], [0], "p-3", port)}, heartbeats={"prefill": ["p-2"]}
        )
    )
    d.start_load_kv()
    Finished(p, d).until(sending=("p-3",), recving=("d-3",))
    clock.now = start + LEASE + 1  # past the first expiry
    assert p.get_finished() == (None, None)
    clock.now = start + LEASE - 5 + LEASE * 2 / 3 + 1
    assert p.get_finished() == ({"p-2"}, None)
    assert p.take_stats() == {"expired_leases": 1}


@transports
def test_done_before_its_lease_frees_once_the_lease_comes(
    make_worker: Callable[..., NixlConnectorWorker],
    serve: Callable[..., int],
    clock: Clock,
    transport: str,
) -> None:
    """The reader can be quicker than the step that tells the prefill worker about the lease:
    the early `done` is kept, and the lease ends the moment it comes."""
    p = make_worker("kv_producer", transport)
    d = make_worker("kv_consumer", transport)
    port = serve(p)
    lease(p, clock.now + LEASE, "p-0")
    # p-1's done goes first; p-0's, after it, marks its arrival.
    load(d, **{"d-1": recv([], [0], "p-1", port), "d-0": recv([], [0], "p-0", port)})
    finished = Finished(p, d).until(sending=("p-0",), recving=("d-1", "d-0"))
    assert finished.sending == ["p-0"]
    lease(p, clock.now + LEASE, "p-1")
    assert p.get_finished() == ({"p-1"}, None)
    assert p.get_finished() == (None, None)
    assert "expired_leases" not in p.take_stats()


@transports
def test_a_bad_read_fails_its_request_alone(
    make_worker: Callable[..., NixlConnectorWorker],
    serve: Callable[..., int],
    clock: Clock,
    transport: str,
) -> None:
    """Remote blocks the prefill side does not have (stale ids) fail that load: its blocks are
    reported invalid, the request's load ends, the prefill side's lease stays, and the next
    read from the same engine works."""
    p = make_worker("kv_producer", transport)
    d = make_worker("kv_consumer", transport)
    port = serve(p)
    lease(p, clock.now + LEASE, "p-1", "p-2")
    load(d, **{"d-1": recv([4, 5], [NUM_BLOCKS, NUM_BLOCKS + 1], "p-1", port)})
    Finished(d).until(recving=("d-1",))
    assert d.take_invalid_block_ids() == {4, 5}
    assert d.take_stats()["failed_transfers"] == 1
    assert not d.kv_cache.any()
    load(d, **{"d-2": recv([6], [3], "p-2", port)})
    finished = Finished(p, d).until(sending=("p-2",), recving=("d-2",))
    assert finished.sending == ["p-2"]  # p-1 waits for its lease
    assert torch.equal(d.kv_cache[6], p.kv_cache[3]) and d.take_invalid_block_ids() == set()


def test_handshake_failure_fails_that_engines_requests(
    make_worker: Callable[..., NixlConnectorWorker],
    serve: Callable[..., int],
    clock: Clock,
) -> None:
    """The instance at the address is another engine (restarted with a new id): every request
    waiting for the engine named fails, once; one for the engine that answers still reads."""
    p = make_worker("kv_producer")
    d = make_worker("kv_consumer")
    port = serve(p)
    lease(p, clock.now + LEASE, "p-3")
    load(
        d,
        **{
            "d-1": recv([1], [0], "p-1", port, engine="gone"),
            "d-2": recv([2, 3], [1, 2], "p-2", port, engine="gone"),
            "d-3": recv([4], [5], "p-3", port),
        },
    )
    Finished(p, d).until(sending=("p-3",), recving=("d-1", "d-2", "d-3"))
    assert d.take_invalid_block_ids() == {1, 2, 3}
    why = (
        "the KV handshake with prefill engine gone failed: the instance there is engine "
        "prefill, not gone (restarted?)"
    )
    assert d.take_load_errors() == {"d-1": why, "d-2": why}
    stats = d.take_stats()
    assert (stats["handshake_failures"], stats["failed_transfers"], stats["transfers"]) == (1, 2, 1)
    assert torch.equal(d.kv_cache[4], p.kv_cache[5])


def test_incompatible_cache_fails_the_handshake(
    make_worker: Callable[..., NixlConnectorWorker],
    serve: Callable[..., int],
    clock: Clock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A cache of another dtype has another compatibility hash: the read fails at the
    handshake, with the reason logged, before any byte moves."""
    p = make_worker("kv_producer")
    d = make_worker("kv_consumer", kv_cache=cache(NUM_BLOCKS, False).to(torch.float16))
    load(d, **{"d-1": recv([1], [0], "p-1", serve(p))})
    Finished(d).until(recving=("d-1",))
    assert d.take_invalid_block_ids() == {1}
    assert d.take_stats() == {"handshake_failures": 1, "failed_transfers": 1}
    assert "compatibility hash mismatch" in caplog.text
    # The request's reason names what differs, and no address.
    (why,) = d.take_load_errors().values()
    assert why.endswith(
        f"compatibility hash mismatch (prefill {p.compat_hash}, decode {d.compat_hash}): "
        "kv_cache_dtype: prefill float32, decode float16"
    )
    assert "127.0.0.1" not in why


@pytest.mark.parametrize(
    ("decode_state_size", "decode_tp", "reason"),
    [
        (
            8,
            1,
            "state_layout: prefill 2 x (conv [128, 3] bfloat16, ssm [128, 16] float32) over TP 1, "
            "decode 2 x (conv [128, 3] bfloat16, ssm [128, 8] float32) over TP 1",
        ),
        (
            16,
            2,
            "state_layout: prefill 2 x (conv [128, 3] bfloat16, ssm [128, 16] float32) over TP 1, "
            "decode 2 x (conv [128, 3] bfloat16, ssm [128, 16] float32) over TP 2",
        ),
    ],
    ids=["state-layout", "tp"],
)
def test_a_state_model_handshake_refuses_what_it_cannot_read(
    tmp_path: Path,
    serve: Callable[..., int],
    clock: Clock,
    decode_state_size: int,
    decode_tp: int,
    reason: str,
) -> None:
    """Mambas that register caches of one shape: one whose state differs (16 and 8 values per
    channel), or whose TP differs (its ranks hold other shares of the channels: vLLM too hands
    a hybrid's state over between equal TP sizes only), is refused at the handshake, the reason
    naming both sides."""
    configs = []
    for role, state_size, tp in (
        ("kv_producer", 16, 1),
        ("kv_consumer", decode_state_size, decode_tp),
    ):
        model = make_tiny_model("mamba", tmp_path / role, state_size=state_size)
        configs.append(kv_config(str(model), role, role, tp=tp, kv_lease_duration=LEASE))
    why = handshake_refusal(*configs, serve)
    assert reason in why, why


def handshake_refusal(prefill: EngineConfig, decode: EngineConfig, serve: Callable) -> str:
    """Why a decode worker of `decode` fails its read from a prefill worker of `prefill`
    (caches of one shape)."""
    workers = []
    for config in (prefill, decode):
        worker = NixlConnectorWorker(config, 0)
        worker.register_kv_caches(cache(NUM_BLOCKS, config is prefill))
        workers.append(worker)
    p, d = workers
    try:
        load(d, **{"d-1": recv([1], [0], "p-1", serve(p), engine="kv_producer")})
        Finished(d).until(recving=("d-1",))
        (why,) = d.take_load_errors().values()
        return why
    finally:
        for worker in workers:
            worker.shutdown()


def test_a_decode_drafter_the_prefill_side_lacks_fails_the_handshake(
    model: str, serve: Callable[..., int], clock: Clock
) -> None:
    """A draft model's KV layers travel in the target's blocks: a decode instance with a
    draft model refuses a prefill instance without one, naming both sides (the caches here
    are of one shape, as if the layer counts matched)."""
    prefill = kv_config(model, "kv_producer", "kv_producer", kv_lease_duration=LEASE)
    decode = kv_config(model, "kv_consumer", "kv_consumer", kv_lease_duration=LEASE)
    spec = {"method": "draft_model", "model": model, "num_speculative_tokens": 2}
    decode.speculative_config = SpeculativeConfig.from_any(spec)
    decode.speculative_config.check_engine(
        decode.model_config, decode.scheduler_config, decode.parallel_config
    )
    why = handshake_refusal(prefill, decode, serve)
    assert "drafter: prefill none, decode draft_model LlamaForCausalLM of 2 layers" in why


def test_gguf_blocks_or_kv_scales_on_one_side_only_fail_the_handshake(
    model: str, serve: Callable[..., int], clock: Clock
) -> None:
    """Weights in GGUF blocks compute other KV than dequantized ones: the decode side refuses
    a prefill side that differs, naming both (set here past ModelConfig's own checks, which
    ask for a .gguf file)."""
    prefill = kv_config(model, "kv_producer", "kv_producer", kv_lease_duration=LEASE)
    decode = kv_config(model, "kv_consumer", "kv_consumer", kv_lease_duration=LEASE)
    decode.model_config.quantization = "gguf"
    decode.cache_config.calculate_kv_scales = True
    why = handshake_refusal(prefill, decode, serve)
    assert "quantization: prefill none, decode gguf" in why
    # An fp8 cache's codes mean nothing under other scales (runners/kv_scales.py).
    assert "kv_scales: prefill 1.0, decode calculated" in why


@transports
def test_undecodable_notification_is_dropped_and_counted(
    make_worker: Callable[..., NixlConnectorWorker],
    serve: Callable[..., int],
    clock: Clock,
    transport: str,
) -> None:
    p = make_worker("kv_producer", transport)
    d = make_worker("kv_consumer", transport)
    port = serve(p)
    lease(p, clock.now + LEASE, "p-1", "p-2")
    load(d, **{"d-1": recv([], [0], "p-1", port)})
    Finished(p, d).until(sending=("p-1",), recving=("d-1",))
    payload = msgspec.msgpack.decode(p.get_handshake_metadata(), type=HandshakePayload)
    agent = msgspec.msgpack.decode(payload.agent_metadata, type=AgentMetadata)
    # Known already: adding it again names it.
    d.transport.send_notif(d.transport.add_remote_agent(agent.agent_metadata), b"\xc1garbage")
    load(d, **{"d-2": recv([], [0], "p-2", port)})
    Finished(p, d).until(sending=("p-2",), recving=("d-2",))
    assert p.take_stats() == {"failed_notifications": 1}


def test_two_decode_ranks_read_one_prefill_rank(
    make_worker: Callable[..., NixlConnectorWorker],
    serve: Callable[..., int],
    clock: Clock,
) -> None:
    """Decode TP 2 from prefill TP 1: each decode rank reads whole blocks and keeps its own
    heads; the prefill side frees only once both readers are done."""
    heads = BLOCK_SHAPE[3]
    p = make_worker("kv_producer")
    ranks = [
        make_worker(
            "kv_consumer",
            kv_cache=cache(NUM_BLOCKS, False, num_kv_heads=heads // 2),
            tp=2,
            tp_rank=r,
        )
        for r in range(2)
    ]
    port = serve(p)
    lease(p, clock.now + LEASE, "p-0", "p-1")
    load(ranks[0], **{"d-1": recv([3, 4], [8, 9], "p-1", port)})
    Finished(ranks[0]).until(recving=("d-1",))
    # Both ranks' empty reads of p-0 after it: once p-0 is free, rank 0's done for p-1 has
    # arrived too, and one reader of two does not free p-1's blocks.
    load(ranks[0], **{"d-0": recv([], [0], "p-0", port)})
    load(ranks[1], **{"d-0": recv([], [0], "p-0", port)})
    finished = Finished(p, *ranks).until(sending=("p-0",), recving=("d-0",))
    assert finished.sending == ["p-0"]
    load(ranks[1], **{"d-1": recv([3, 4], [8, 9], "p-1", port)})
    Finished(p, ranks[1]).until(sending=("p-1",), recving=("d-1",))
    for r, rank in enumerate(ranks):
        part = slice(r * heads // 2, (r + 1) * heads // 2)
        assert torch.equal(rank.kv_cache[[3, 4]], p.kv_cache[[8, 9]][..., part, :])
        assert rank.take_invalid_block_ids() == set()


def test_a_latent_cache_is_read_from_one_prefill_rank(
    make_worker: Callable[..., NixlConnectorWorker],
    serve: Callable[..., int],
    clock: Clock,
) -> None:
    """MLA's latent (one part per block, no heads) is the same on every rank: a decode rank of
    TP 1 reads it from the first of two prefill ranks, byte for byte and no more, and the other
    only hears that it is done; two decode ranks of one prefill rank each read whole blocks."""
    shape = (NUM_BLOCKS, BLOCK_SHAPE[0], 1, BLOCK_SHAPE[2], 1, BLOCK_SHAPE[4])
    # Replicas that differ, so that the bytes say which rank was read.
    prefill = [
        make_worker("kv_producer", kv_cache=torch.randn(shape), tp=2, tp_rank=r) for r in range(2)
    ]
    d = make_worker("kv_consumer", kv_cache=torch.zeros(shape))
    port = serve(*prefill)
    for p in prefill:
        lease(p, clock.now + LEASE, "p-0")
    meta = recv([3, 4], [8, 9], "p-0", port)
    load(d, **{"d-0": msgspec.structs.replace(meta, remote_tp_size=2)})
    finished = Finished(*prefill, d).until(recving=("d-0",))
    poll(lambda: finished.poll().sending == ["p-0", "p-0"])
    assert torch.equal(d.kv_cache[[3, 4]], prefill[0].kv_cache[[8, 9]])
    assert d.take_stats()["transfer_bytes"] == 2 * prefill[0].kv_cache[0].nbytes

    readers = [
        make_worker("kv_consumer", engine_id=f"decode-{r}", kv_cache=torch.zeros(shape), tp=2,
                    tp_rank=r)
        for r in range(2)
    ]  # fmt: skip
    lease(prefill[0], clock.now + LEASE, "p-1")
    for rank in readers:
        load(rank, **{"d-1": recv([5], [10], "p-1", port)})
    Finished(prefill[0], *readers).until(sending=("p-1",), recving=("d-1",))
    for rank in readers:
        assert torch.equal(rank.kv_cache[5], prefill[0].kv_cache[10])


def test_handshake_metadata_describes_the_registered_cache(
    make_worker: Callable[..., NixlConnectorWorker],
) -> None:
    p = make_worker("kv_producer")
    payload = msgspec.msgpack.decode(p.get_handshake_metadata(), type=HandshakePayload)
    agent = msgspec.msgpack.decode(payload.agent_metadata, type=AgentMetadata)
    layers, _, block_size, heads, head_dim = BLOCK_SHAPE
    assert (agent.engine_id, agent.tp_rank, agent.tp_size, agent.transport) == (
        "prefill",
        0,
        1,
        "nixl",
    )
    assert (agent.num_blocks, agent.block_len) == (NUM_BLOCKS, p.kv_cache[0].nbytes)
    assert (agent.block_size, agent.num_kv_heads, agent.head_dim, agent.num_layers) == (
        block_size,
        heads,
        head_dim,
        layers,
    )
    assert (agent.dtype, agent.memory) == ("float32", HOST)
    # Another worker of the same model and layout agrees on the hash.
    d = make_worker("kv_consumer")
    theirs = msgspec.msgpack.decode(d.get_handshake_metadata(), type=HandshakePayload)
    assert theirs.compatibility_hash == payload.compatibility_hash
    d.shutdown()
    d.shutdown()  # idempotent
