"""KV transfer through the NixlConnector, and the prefill -> decode handover of a served request.

Connector: a prefill process registers a KV cache of `mib` MiB with a connector worker, serves
its handshake and holds each request's blocks under a lease; this process is the decode worker.
Per repetition it binds one RecvReqMeta for every block (laid out as the raw benchmark's reads)
and steps start_load_kv() / get_finished() until the request is in finished_recving, then checks
the bytes and waits until the prefill side reports the request in finished_sending. The first
read includes the handshake and is reported apart.

Handover: a prefill and a decode `pdserve serve` per backend. A ~1k-token prompt is prefilled
(max_tokens=1), then streamed from decode with the returned kv_transfer_params; the handover is
the time from the prefill response to decode's first streamed token, and decode's
kv_transfer_seconds metric gives the transfer inside it.

Used by benchmarks/kv_transfer.py, which prints the figures.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import random
import statistics
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import msgspec
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.config import EngineConfig  # noqa: E402
from pdserve.kv_connector.nixl.handshake import HandshakeServer, fetch_agent_metadata  # noqa: E402
from pdserve.kv_connector.nixl.metadata import NixlConnectorMetadata, Notif, RecvReqMeta  # noqa: E402
from pdserve.kv_connector.nixl.worker import NixlConnectorWorker  # noqa: E402
from pdserve.kv_connector.transport import Desc, Transport, XferState, block_descs  # noqa: E402
from pdserve.utils import get_open_port  # noqa: E402

if TYPE_CHECKING:
    from tests.utils.server import RemoteServer

# tests.utils (transformers, openai) is imported where used: every prefill process imports this
# module, and transformers alone takes seconds.

HOST = "127.0.0.1"
POLL_S = 0.0002  # the decode worker's step, as the raw benchmark's reader polls
LEASE_POLL_S = 0.002  # an engine holding leases polls its workers every 2 ms (EngineCoreProc)
LEASE_S = 30.0
TIMEOUT_S = 30.0
MAX_MODEL_LEN = 2048
PROMPT_LEN = 1000


def make_model(root: Path) -> Path:
    from tests.utils.tiny_models import make_tiny_model

    return make_tiny_model("llama", root / "llama", max_position_embeddings=MAX_MODEL_LEN)


def engine_config(model: Path, backend: str, role: str, block_size: int = 16) -> EngineConfig:
    return EngineConfig.from_engine_args(
        model=str(model),
        dtype="float32",
        block_size=block_size,
        max_model_len=MAX_MODEL_LEN,
        kv_transfer_config={
            "kv_connector": "NixlConnector",
            "kv_role": role,
            "kv_connector_extra_config": {"transport": backend},
        },
    )


def block_size_for(model: Path, block_len: int) -> int:
    """The block size (tokens) whose KV block, every layer, is `block_len` bytes."""
    mc = engine_config(model, "nixl", "kv_both").model_config
    per_token = mc.num_layers * 2 * mc.num_kv_heads * mc.head_dim * mc.torch_dtype.itemsize
    if block_len % per_token:
        raise ValueError(
            f"blocks of {block_len} bytes: not a whole number of {per_token}-byte tokens"
        )
    return block_len // per_token


def kv_cache(config: EngineConfig, num_blocks: int, pattern: bool) -> torch.Tensor:
    """Block-major [blocks, layers, 2, block_size, kv_heads, head_dim]: a pattern, or zeros."""
    mc = config.model_config
    shape = (
        num_blocks,
        mc.num_layers,
        2,
        config.cache_config.block_size,
        mc.num_kv_heads,
        mc.head_dim,
    )
    if not pattern:
        return torch.zeros(shape, dtype=mc.torch_dtype)
    nbytes = num_blocks * torch.Size(shape[1:]).numel() * mc.torch_dtype.itemsize
    return (
        torch.arange(nbytes // 4, dtype=torch.int32)
        .view(torch.uint8)
        .view(mc.torch_dtype)
        .view(shape)
    )


def remote_block_ids(num_blocks: int, scattered: bool, contiguous_descs: int) -> list[int]:
    """Remote block of local block i: the raw benchmark's layout (single blocks or runs, shuffled)."""
    run = 1 if scattered else max(1, num_blocks // contiguous_descs)
    order = list(range(num_blocks // run))
    random.Random(0).shuffle(order)
    return [r * run + k for r in order for k in range(run)]


def _prefill(conn: Connection, model: Path, backend: str, block_size: int, num_blocks: int) -> None:
    """Serve the handshake; lease each request's blocks; report when its reader is done."""
    config = engine_config(model, backend, "kv_producer", block_size)
    connector = NixlConnectorWorker(config, tp_rank=0)
    server = None
    try:
        connector.register_kv_caches(kv_cache(config, num_blocks, pattern=True))
        server = HandshakeServer(HOST, 0, {0: connector.get_handshake_metadata()})
        conn.send((config.kv_transfer_config.engine_id, server.port))
        held = 0
        while True:
            if conn.poll(LEASE_POLL_S if held else None):
                cmd, req_id = conn.recv()
                if cmd == "stop":
                    return
                lease = NixlConnectorMetadata(reqs_to_send={req_id: time.time() + LEASE_S})
                connector.bind(lease)
                connector.start_load_kv()
                held += 1
                conn.send(("leased", req_id, 0.0))
                continue
            connector.start_load_kv()
            sending, _ = connector.get_finished()
            for req_id in sending or ():
                held -= 1
                conn.send(("sent", req_id, time.monotonic()))
    finally:
        if server is not None:
            server.close()
        connector.shutdown()


def _expect(conn: Connection, kind: str, req_id: str) -> float:
    if not conn.poll(TIMEOUT_S):
        raise TimeoutError(f"prefill process: no {kind!r} for {req_id} within {TIMEOUT_S:.0f} s")
    got_kind, got_id, when = conn.recv()
    assert (got_kind, got_id) == (kind, req_id), (got_kind, got_id, kind, req_id)
    return when


def _connector_read(
    connector: NixlConnectorWorker, meta: bytes, req_id: str
) -> tuple[float, float]:
    """Bind one read and step until it is in finished_recving: (seconds, longest step)."""
    start = time.perf_counter()
    connector.bind(msgspec.msgpack.decode(meta, type=NixlConnectorMetadata))
    longest = 0.0  # the connector's part of one step: what that step's forward pass waits for
    while True:  # the worker's step: start_load_kv, (forward), get_finished
        step = time.perf_counter()
        connector.start_load_kv()
        _, recving = connector.get_finished()
        longest = max(longest, time.perf_counter() - step)
        if recving and req_id in recving:
            return time.perf_counter() - start, longest
        if time.perf_counter() - start > TIMEOUT_S:
            raise TimeoutError(f"read {req_id} not done within {TIMEOUT_S:.0f} s")
        time.sleep(POLL_S)


def _transport_read(
    transport: Transport, agent: str, local: list[Desc], remote: list[Desc]
) -> float:
    """The same READ on the connector's own transport, polled as the raw benchmark does."""
    notif = msgspec.msgpack.encode(
        Notif("heartbeat", [])
    )  # a notification the prefill side ignores
    start = time.perf_counter()
    handle = transport.read(agent, local, remote, notif)
    while (state := transport.check_state(handle)) is XferState.PENDING:
        time.sleep(POLL_S)
    elapsed = time.perf_counter() - start
    transport.release(handle)
    assert state is XferState.DONE, state
    return elapsed


def connector_transfer(
    backend: str,
    model: Path,
    num_blocks: int,
    block_len: int,
    scattered: bool,
    reps: int,
    contiguous_descs: int,
) -> dict[str, float]:
    """READ every block of a prefill process through the connector, reps + 1 times (the first
    with the handshake); GB/s of the median read, bind to finished_recving. Each timed read is
    paired with the same READ straight on the connector's transport (alternating which goes
    first): `paired_ratio` is the connector's cost with the machine's drift taken out."""
    block_size = block_size_for(model, block_len)
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    proc = ctx.Process(
        target=_prefill, args=(child_conn, model, backend, block_size, num_blocks), daemon=True
    )
    proc.start()
    connector = None
    try:
        config = engine_config(model, backend, "kv_consumer", block_size)
        connector = NixlConnectorWorker(config, tp_rank=0)
        cache = kv_cache(config, num_blocks, pattern=False)
        assert cache[0].nbytes == block_len, (cache[0].nbytes, block_len)
        connector.register_kv_caches(cache)
        if not conn.poll(120):
            raise TimeoutError("prefill process did not start")
        engine_id, port = conn.recv()
        local = list(range(num_blocks))
        remote = remote_block_ids(num_blocks, scattered, contiguous_descs)
        expected = kv_cache(config, num_blocks, pattern=True)[remote].view(torch.uint8)
        transport, agent = connector.transport, ""
        descs = block_descs(0, local, 0, remote, block_len)
        times, raw_times, lags, stalls = [], [], [], []
        for rep in range(reps + 1):
            req_id = f"bench-{rep}"
            conn.send(("lease", req_id))
            _expect(conn, "leased", req_id)
            meta = msgspec.msgpack.encode(
                NixlConnectorMetadata(
                    reqs_to_recv={
                        req_id: RecvReqMeta(local, remote, engine_id, req_id, HOST, port, 1)
                    }
                )
            )
            if rep % 2 == 1:
                raw_times.append(_transport_read(transport, agent, *descs))
            cache.zero_()
            elapsed, longest = _connector_read(connector, meta, req_id)
            done = time.monotonic()
            stats = connector.get_worker_stats()
            if connector.get_block_ids_with_load_errors() or stats.get("transfers") != 1:
                raise RuntimeError(f"{backend}: read {req_id} failed: {stats}")
            if not torch.equal(cache.view(torch.uint8), expected):
                raise RuntimeError(f"{backend}: read {req_id} brought wrong bytes")
            lags.append(_expect(conn, "sent", req_id) - done)
            if rep == 0:  # the connector has the prefill agent now: its name, for the raw reads
                remote_agent = fetch_agent_metadata(
                    HOST, port, 0, None, engine_id, TIMEOUT_S
                ).agent_metadata
                agent = transport.add_remote_agent(remote_agent)
            elif rep % 2 == 0:
                raw_times.append(_transport_read(transport, agent, *descs))
            times.append(elapsed)
            stalls.append(longest)
        read = statistics.median(times[1:])
        return {
            "descs": int(stats["transfer_descriptors"]),
            "gbps": num_blocks * block_len / read / 1e9,
            "read_ms": read * 1e3,
            "paired_ratio": statistics.median(r / c for r, c in zip(raw_times, times[1:])),
            "step_stall_ms": statistics.median(stalls[1:]) * 1e3,
            "first_read_ms": times[0] * 1e3,
            "handshake_ms": (times[0] - read) * 1e3,
            "done_seen_by_prefill_ms": statistics.median(lags) * 1e3,
        }
    finally:
        if connector is not None:
            connector.shutdown()
        if proc.is_alive():
            conn.send(("stop", ""))
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join()


# ---- handover between two servers -------------------------------------------------------------


def _serve(model: Path, backend: str, role: str) -> RemoteServer:
    from tests.utils.server import RemoteServer

    kv = {
        "kv_connector": "NixlConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"transport": backend},
    }
    return RemoteServer(
        [
            "serve",
            "--model",
            str(model),
            "--dtype",
            "float32",
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--kv-transfer-config",
            json.dumps(kv),
        ],
        env={"PDSERVE_SIDE_CHANNEL_PORT": str(get_open_port())},
    )


def _transfer_counters(server: RemoteServer) -> tuple[float, float]:
    return server.metric("kv_transfer_seconds_total"), server.metric("kv_transfers_total")


def _first_token_s(client: httpx.Client, url: str, body: dict) -> float:
    """Stream a completion; seconds until its first token arrived."""
    start, first = time.perf_counter(), None
    with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as stream:
        stream.raise_for_status()
        for line in stream.iter_lines():  # read to the end: leaving early would abort the request
            if (
                first is None
                and line.startswith("data: {")
                and json.loads(line[6:])["choices"][0]["token_ids"]
            ):
                first = time.perf_counter()
    if first is None:
        raise RuntimeError(f"{url} streamed no token")
    return first - start


def _handover_once(
    client: httpx.Client, prefill: RemoteServer, decode: RemoteServer, model: Path, seed: int
) -> tuple[float, float, float]:
    """(handover, transfer, baseline) seconds of one fresh ~1k-token prompt; the baseline is the
    first token of a 1-token prompt on decode, with no transfer."""
    from tests.utils.tiny_models import VOCAB_SIZE

    rng = random.Random(seed)
    prompt = [rng.randrange(3, VOCAB_SIZE) for _ in range(PROMPT_LEN)]
    body = {"model": str(model), "temperature": 0, "ignore_eos": True, "max_tokens": 2}
    baseline = _first_token_s(client, decode.url, {**body, "prompt": prompt[:1]})
    seconds, count = _transfer_counters(decode)
    resp = client.post(
        f"{prefill.url}/v1/completions",
        json={
            **body,
            "prompt": prompt,
            "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True},
        },
    )
    resp.raise_for_status()
    params = resp.json()["kv_transfer_params"]
    handover = _first_token_s(
        client, decode.url, {**body, "prompt": prompt, "kv_transfer_params": params}
    )
    deadline = time.monotonic() + 10
    while (new := _transfer_counters(decode))[1] < count + 1:  # stats ride on a later output
        if time.monotonic() > deadline:
            raise RuntimeError(f"decode counted no KV transfer (kv_transfers_total {new[1]})")
        time.sleep(0.05)
    if new[1] != count + 1:
        raise RuntimeError(f"decode counted {new[1] - count:.0f} KV transfers for one request")
    prefill.wait_pool_full(10)  # the done notification freed the prefill side's blocks
    return handover, new[0] - seconds, baseline


def handover(backend: str, model: Path, reps: int) -> dict[str, float]:
    """Median handover (prefill response -> decode's first token) of a 1k-token prompt."""
    servers: list[RemoteServer] = []
    try:
        for role in ("kv_producer", "kv_consumer"):
            servers.append(_serve(model, backend, role))
        prefill, decode = servers
        with httpx.Client(timeout=60) as client:
            _handover_once(client, prefill, decode, model, seed=-1)  # the handshake
            samples = [_handover_once(client, prefill, decode, model, seed) for seed in range(reps)]
    finally:
        for server in servers:
            server.stop()
    return {
        "prompt_tokens": PROMPT_LEN,
        "handover_ms": statistics.median(h for h, _, _ in samples) * 1e3,
        "transfer_ms": statistics.median(t for _, t, _ in samples) * 1e3,
        "overhead_ms": statistics.median(h - t for h, t, _ in samples) * 1e3,
        "overhead_min_ms": min(h - t for h, t, _ in samples) * 1e3,
        "baseline_ms": statistics.median(b for _, _, b in samples) * 1e3,
        "extra_ms": statistics.median(h - t - b for h, t, b in samples) * 1e3,
    }
