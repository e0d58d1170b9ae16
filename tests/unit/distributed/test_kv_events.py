"""KV cache events: vLLM's wire layout, what the block pool emits, and the stream over real
ZMQ sockets, a late subscriber rebuilding the cache map from the replay socket included."""

from __future__ import annotations

import time
from pathlib import Path

import msgspec
import pytest
import zmq

from pdserve.config.kv_events import KVEventsConfig
from pdserve.distributed.kv_event_subscriber import CachedBlocks, KVEventSubscriber
from pdserve.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
    external_block_hash,
    make_event_publisher,
)
from pdserve.request import Request
from pdserve.sampling_params import SamplingParams
from pdserve.scheduler.block_pool import BlockPool
from pdserve.scheduler.kv_cache_manager import KVCacheManager
from pdserve.scheduler.kv_cache_utils import hash_block_tokens

BLOCK_SIZE = 4


def chain(token_ids: list[int]) -> list[bytes]:
    hashes, parent = [], None
    for start in range(0, len(token_ids) - BLOCK_SIZE + 1, BLOCK_SIZE):
        parent = hash_block_tokens(parent, token_ids[start : start + BLOCK_SIZE])
        hashes.append(parent)
    return hashes


def stored_map(hashes: list[int], parent: int | None, tokens: list[int]) -> dict:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": 4,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }


def test_wire_layout_is_vllms() -> None:
    """Current vLLM's layout, the one vllm-router 0.1.17 accepts: a batch is the positional
    [ts, events, data_parallel_rank]; an event is a map tagged by "type", every field present
    (None where unset); block hashes are 64-bit unsigned ints."""
    batch = KVEventBatch(
        ts=12.5,
        events=[
            BlockStored([1, 2**64 - 1], None, [5, 6, 7, 8, 9, 10, 11, 12], 4, None, "GPU", None),
            BlockStored([3], 2, [1, 2, 3, 4], 4, None, "GPU", None),
            BlockRemoved([1], "GPU"),
            AllBlocksCleared(),
        ],
    )
    plain = msgspec.msgpack.decode(msgspec.msgpack.encode(batch))
    assert plain == [
        12.5,
        [
            stored_map([1, 2**64 - 1], None, [5, 6, 7, 8, 9, 10, 11, 12]),
            stored_map([3], 2, [1, 2, 3, 4]),
            {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"},
            {"type": "AllBlocksCleared"},
        ],
        None,
    ]
    # A batch from vLLM with a data-parallel rank, or from an older one without it, decodes.
    cleared = {"type": "AllBlocksCleared"}
    for wire, rank in (([1.0, [cleared], 3], 3), ([1.0, [cleared]], None)):
        batch = msgspec.msgpack.decode(msgspec.msgpack.encode(wire), type=KVEventBatch)
        assert batch.data_parallel_rank == rank and batch.events == [AllBlocksCleared()]


def test_external_hash_is_the_last_eight_bytes() -> None:
    digest = bytes(range(32))
    assert external_block_hash(digest) == int.from_bytes(bytes(range(24, 32)), "big")


def test_block_pool_emits_stored_removed_and_cleared() -> None:
    pool = BlockPool(8, True, BLOCK_SIZE, enable_kv_cache_events=True)
    tokens = list(range(100, 112))
    hashes = chain(tokens)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(hashes, blocks, 0, 2, tokens)
    pool.cache_full_blocks(hashes, blocks, 2, 3, tokens)
    ext = [external_block_hash(h) for h in hashes]
    assert pool.take_events() == [
        BlockStored(ext[:2], None, tokens[:8], BLOCK_SIZE, None, "GPU", None),
        BlockStored(ext[2:], ext[1], tokens[8:], BLOCK_SIZE, None, "GPU", None),
    ]
    assert pool.take_events() == []

    # A duplicate in the middle is skipped (announced before): two runs, each with its parent.
    dup = pool.get_new_blocks(3)
    other = pool.get_new_blocks(1)
    pool.cache_full_blocks([hashes[0]], other, 0, 1, tokens)  # already cached: no event
    assert pool.take_events() == []
    pool.free_blocks(blocks)
    pool.free_blocks(dup)
    # Reuse evicts the least recently freed cached blocks first: one BlockRemoved each.
    pool.get_new_blocks(pool.get_num_free_blocks())
    removed = [e for e in pool.take_events() if isinstance(e, BlockRemoved)]
    assert sorted(h for e in removed for h in e.block_hashes) == sorted(ext)

    pool2 = BlockPool(8, True, BLOCK_SIZE, enable_kv_cache_events=True)
    b = pool2.get_new_blocks(3)
    pool2.cache_full_blocks(hashes, b, 0, 3, tokens)
    pool2.free_blocks(b)
    pool2.take_events()
    assert pool2.reset_prefix_cache()
    assert pool2.take_events() == [AllBlocksCleared()]


def test_split_runs_around_a_block_cached_elsewhere() -> None:
    pool = BlockPool(8, True, BLOCK_SIZE, enable_kv_cache_events=True)
    tokens = list(range(12))
    hashes = chain(tokens)
    ext = [external_block_hash(h) for h in hashes]
    middle = pool.get_new_blocks(1)
    pool.cache_full_blocks(hashes[1:2], middle, 0, 1, tokens[4:8])
    pool.take_events()
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(hashes, blocks, 0, 3, tokens)
    assert pool.take_events() == [
        BlockStored(ext[:1], None, tokens[:4], BLOCK_SIZE, None, "GPU", None),
        BlockStored(ext[2:], ext[1], tokens[8:], BLOCK_SIZE, None, "GPU", None),
    ]


def test_salted_requests_store_chains_of_their_own() -> None:
    """The same tokens under two cache_salts are two chains in the events: a router following
    them never sends one tenant's prompt to the other's blocks."""
    manager = KVCacheManager(8, BLOCK_SIZE, 64, enable_caching=True, enable_kv_cache_events=True)
    tokens = list(range(100, 109))  # two full blocks and a token
    requests = [
        Request(salt, tokens, SamplingParams(), None, cache_salt=salt)
        for salt in ("tenant-a", "tenant-b")
    ]
    for request in requests:
        assert manager.get_computed_blocks(request) == ([], 0)
        manager.allocate_slots(request, len(tokens))
    events = manager.block_pool.take_events()
    for event, request in zip(events, requests, strict=True):
        first = hash_block_tokens(None, tokens[:4], (request.cache_salt,))
        salted = [first, hash_block_tokens(first, tokens[4:8])]
        assert event == BlockStored(
            [external_block_hash(h) for h in salted], None, tokens[:8], 4, None, "GPU", None
        )
    for request in requests:
        request.num_computed_tokens = len(tokens)
        manager.free(request)


def test_events_off_keeps_nothing() -> None:
    pool = BlockPool(8, True, BLOCK_SIZE)
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(chain([1, 2, 3, 4]), blocks, 0, 1, [1, 2, 3, 4])
    assert pool.events is None and pool.take_events() == []
    assert not make_event_publisher(None).publishes
    assert not make_event_publisher(KVEventsConfig(enable_kv_cache_events=False)).publishes


def stored(h: int) -> KVEventBatch:
    return KVEventBatch(
        ts=time.time(), events=[BlockStored([h], None, [h] * 4, 4, None, "GPU", None)]
    )


@pytest.fixture
def endpoints(tmp_path: Path) -> tuple[str, str]:
    return f"ipc://{tmp_path}/events", f"ipc://{tmp_path}/replay"


def receive_until(sub: KVEventSubscriber, n: int, timeout_s: float = 5.0) -> list[KVEventBatch]:
    batches: list[KVEventBatch] = []
    deadline = time.monotonic() + timeout_s
    while len(batches) < n and time.monotonic() < deadline:
        batches += sub.poll(100)
    return batches


def test_stream_frames_sequence_and_topic(endpoints: tuple[str, str]) -> None:
    endpoint, replay = endpoints
    publisher = ZmqEventPublisher(
        KVEventsConfig(True, endpoint=endpoint, replay_endpoint=replay, topic="kv@h@m")
    )
    raw = zmq.Context.instance().socket(zmq.SUB)
    raw.setsockopt(zmq.SUBSCRIBE, b"")
    raw.connect(endpoint)
    try:
        time.sleep(0.3)  # a SUB socket hears only what is sent after it joined
        for h in range(3):
            publisher.publish(stored(h))
        frames = [raw.recv_multipart() for _ in range(3)] if raw.poll(5000) else []
        assert [f[0] for f in frames] == [b"kv@h@m"] * 3
        assert [int.from_bytes(f[1], "big") for f in frames] == [0, 1, 2]
        assert len(frames[0][1]) == 8
        batch = msgspec.msgpack.decode(frames[2][2], type=KVEventBatch)
        assert batch.events[0].block_hashes == [2]
    finally:
        raw.close(linger=0)
        publisher.shutdown()


def test_late_subscriber_rebuilds_from_replay(endpoints: tuple[str, str]) -> None:
    endpoint, replay = endpoints
    publisher = ZmqEventPublisher(
        KVEventsConfig(True, endpoint=endpoint, replay_endpoint=replay, buffer_steps=100)
    )
    truth = CachedBlocks()
    try:
        for h in range(10):
            batch = stored(h)
            truth.apply(batch)
            publisher.publish(batch)
        removal = KVEventBatch(ts=0.0, events=[BlockRemoved([3, 4], "GPU")])
        truth.apply(removal)
        publisher.publish(removal)
        time.sleep(0.2)
        # Joined after all of it: the replay socket gives back the whole history.
        sub = KVEventSubscriber(endpoint, replay)
        rebuilt = CachedBlocks()
        try:
            for batch in sub.replay_from(0):
                rebuilt.apply(batch)
            assert rebuilt.hashes == truth.hashes == {0, 1, 2, 5, 6, 7, 8, 9}
            assert sub.next_seq == 11
            # Live batches continue the sequence; one it missed is fetched from the replay.
            time.sleep(0.3)
            publisher.publish(stored(20))
            for batch in receive_until(sub, 1):
                rebuilt.apply(batch)
            assert 20 in rebuilt.hashes and sub.lost == 0
        finally:
            sub.close()
    finally:
        publisher.shutdown()


def test_gap_is_filled_from_replay_and_lost_batches_counted(endpoints: tuple[str, str]) -> None:
    endpoint, replay = endpoints
    publisher = ZmqEventPublisher(
        KVEventsConfig(True, endpoint=endpoint, replay_endpoint=replay, buffer_steps=3)
    )
    sub = KVEventSubscriber(endpoint, replay)
    try:
        time.sleep(0.3)
        publisher.publish(stored(0))
        assert len(receive_until(sub, 1)) == 1
        # Seen by no one: a subscriber that is not reading misses nothing (ZMQ queues), so
        # the gap is made by a second subscriber that joins late and a buffer of 3 batches.
        for h in range(1, 7):
            publisher.publish(stored(h))
        time.sleep(0.2)
        late = KVEventSubscriber(endpoint, replay)
        try:
            time.sleep(0.3)
            publisher.publish(stored(7))
            got = receive_until(late, 1)
            # Batch 7 shows the gap; asked from 0, the publisher holds 5..7 only (7 once: the
            # live copy is a duplicate by then), and 0..4 are counted lost.
            hashes = [b.events[0].block_hashes[0] for b in got]
            assert hashes == [5, 6, 7] and late.lost == 5 and late.next_seq == 8
        finally:
            late.close()
    finally:
        sub.close()
        publisher.shutdown()


def test_bad_endpoint_is_named() -> None:
    with pytest.raises(ValueError, match="kv_events_config.endpoint"):
        KVEventsConfig(True, endpoint="localhost:5557")
    with pytest.raises(ValueError, match="kv_events_config has unknown keys"):
        KVEventsConfig.from_any({"enable_kv_cache_events": True, "port": 1})
    with pytest.raises(ValueError, match="kv_events_config.publisher"):
        KVEventsConfig(True, publisher="kafka")


def test_engine_publishes_its_cache_as_it_changes(tiny_model, endpoints) -> None:
    """Through a real engine, evictions forced by a small pool included: what a subscriber
    rebuilds from the stream is the engine's prefix-cache index, hash for hash."""
    from pdserve import LLM, SamplingParams

    endpoint, replay = endpoints
    config = {
        "enable_kv_cache_events": True,
        "endpoint": endpoint,
        "replay_endpoint": replay,
        "topic": "kv@test",
    }
    params = SamplingParams(max_tokens=4, temperature=0.0)
    with LLM(
        model=tiny_model("llama"),
        dtype="float32",
        max_model_len=128,
        block_size=4,
        num_gpu_blocks_override=16,
        kv_events_config=config,
    ) as llm:
        sub = KVEventSubscriber(endpoint, replay, topic="kv@test")
        try:
            shared = list(range(1, 30))
            prompts = [{"prompt_token_ids": shared + [40 + i] * (3 + i)} for i in range(6)]
            for prompt in prompts:  # one at a time: the small pool evicts earlier prompts' blocks
                llm.generate([prompt], params, use_tqdm=False)
            time.sleep(0.3)
            rebuilt = CachedBlocks()
            batches = sub.replay_from(0)
            for batch in batches:
                rebuilt.apply(batch)
            assert any(isinstance(e, BlockRemoved) for b in batches for e in b.events)
            pool = llm.engine_core.scheduler.kv_cache_manager.block_pool
            index = {external_block_hash(h) for h in pool.cached_block_hash_to_block}
            assert rebuilt.hashes == index and len(index) > 0
            assert sub.lost == 0 and sub.next_seq > len(prompts)
            assert llm.engine_core.reset_prefix_cache()
            time.sleep(0.3)
            for batch in receive_until(sub, 1):
                rebuilt.apply(batch)
            assert rebuilt.hashes == set()
        finally:
            sub.close()


def test_a_restarted_publisher_clears_the_map(endpoints: tuple[str, str]) -> None:
    endpoint, replay = endpoints
    config = KVEventsConfig(True, endpoint=endpoint, replay_endpoint=replay)
    publisher = ZmqEventPublisher(config)
    sub = KVEventSubscriber(endpoint, replay)
    cached = CachedBlocks()
    try:
        time.sleep(0.3)
        for h in range(3):
            publisher.publish(stored(h))
        for batch in receive_until(sub, 3):
            cached.apply(batch)
        assert cached.hashes == {0, 1, 2}
        publisher.shutdown()
        time.sleep(0.5)  # ZMQ closes sockets in the background: the ports are free after
        publisher = ZmqEventPublisher(config)  # the instance came back: sequence from 0
        # Batches sent before the SUB socket has reconnected (and re-subscribed, which happens
        # while it is polled, as a router's listener does) are lost to it; the first it hears
        # goes backwards, which is the restart, and the replay brings back what it missed.
        for h in (7, 8, 9):
            publisher.publish(stored(h))
            for batch in sub.poll(300):
                cached.apply(batch)
        for batch in receive_until(sub, 1, timeout_s=1.0):
            cached.apply(batch)
        assert cached.hashes == {7, 8, 9} and sub.next_seq == 3
    finally:
        sub.close()
        publisher.shutdown()
