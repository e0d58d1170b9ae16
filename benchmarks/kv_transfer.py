"""KV transfer speed between two processes, and the prefill -> decode handover.

Raw transport: an owner process registers `--mib` MiB of 16 KiB KV blocks; this process READs
all of them, either block by block in a random order (one descriptor per block: the scattered
layout of a real KV cache) or as 256 contiguous runs, and reports the median GB/s of several
repetitions per backend.

Connector: the same bytes and layout, as KV blocks of a tiny llama, READ by a NixlConnector
worker from another one (benchmarks/kv_transfer_connector.py); the ratio to the raw transport
(target >= 0.8). Raw and connector alternate `--rounds` times: this reports the median of each
and of the per-round ratios, since a shared machine's speed drifts between measurements.

Handover: a prefill and a decode `pdserve serve` per backend; the time from the prefill response
of a 1k-token prompt to decode's first streamed token, less decode's KV transfer time (target
<= 20 ms).

Usage: python benchmarks/kv_transfer.py [--backend nixl|ucx|all] [--mib 64] [--reps 7]
           [--rounds 3] [--skip-handover] [--json]
Prints tables and a final JSON line (only the JSON line with --json).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# NIXL logs each agent it creates at INFO on stdout, into the table and the JSON line; the
# processes started here (and the servers) inherit this.
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

from pdserve.kv_connector.transport import BACKENDS, Desc, Transport, XferState, make_transport  # noqa: E402

BLOCK_LEN = 16 << 10
CONTIGUOUS_DESCS = 256
REPS = 7
ROUNDS = 3
TARGET_RATIO = 0.8
TARGET_OVERHEAD_MS = 20.0


def fill(num_blocks: int, block_len: int) -> torch.Tensor:
    return torch.arange(num_blocks * block_len // 8, dtype=torch.int64).view(torch.uint8)


def _owner(conn: Connection, backend: str, num_blocks: int, block_len: int) -> None:
    transport = make_transport(backend, "bench-owner")
    transport.register_region(fill(num_blocks, block_len))
    conn.send(transport.get_agent_metadata())
    conn.recv()  # stop
    transport.shutdown()


def _layout(num_blocks: int, block_len: int, scattered: bool) -> tuple[list[Desc], list[Desc]]:
    """Every remote block once, into local slots: one descriptor per block, or per run."""
    run = 1 if scattered else max(1, num_blocks // CONTIGUOUS_DESCS)
    order = list(range(num_blocks // run))
    random.Random(0).shuffle(order)
    local = [Desc(0, i * run * block_len, run * block_len) for i in range(len(order))]
    remote = [Desc(0, r * run * block_len, run * block_len) for r in order]
    return local, remote


def _timed_read(reader: Transport, owner: str, local: list[Desc], remote: list[Desc]) -> float:
    start = time.perf_counter()
    handle = reader.read(owner, local, remote, b"bench")
    # Poll like an engine step would, without spinning on the GIL the ucx service thread needs.
    while (state := reader.check_state(handle)) is XferState.PENDING:
        time.sleep(0.0002)
    elapsed = time.perf_counter() - start
    reader.release(handle)
    assert state is XferState.DONE, state
    return elapsed


def raw_transfer_gbps(backend: str, num_blocks: int, block_len: int, scattered: bool) -> float:
    """Median GB/s of READing num_blocks * block_len bytes from another process."""
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    proc = ctx.Process(
        target=_owner, args=(child_conn, backend, num_blocks, block_len), daemon=True
    )
    proc.start()
    reader = make_transport(backend, "bench-reader")
    try:
        dst = torch.zeros(num_blocks * block_len, dtype=torch.uint8)
        reader.register_region(dst)
        if not conn.poll(120):
            raise TimeoutError("owner process did not start")
        owner = reader.add_remote_agent(conn.recv())
        local, remote = _layout(num_blocks, block_len, scattered)
        _timed_read(reader, owner, local, remote)  # connect and warm up
        src = fill(num_blocks, block_len)
        for ld, rd in zip(local, remote):
            assert torch.equal(
                dst[ld.offset : ld.offset + ld.length], src[rd.offset : rd.offset + rd.length]
            )
        times = [_timed_read(reader, owner, local, remote) for _ in range(REPS)]
        return num_blocks * block_len / statistics.median(times) / 1e9
    finally:
        reader.shutdown()
        conn.send("stop")
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join()


def compare(
    backend: str, model: Path, num_blocks: int, scattered: bool, rounds: int
) -> tuple[dict, dict]:
    """Raw and connector reads of the same layout, alternating; (raw row, connector row)."""
    from kv_transfer_connector import connector_transfer

    raw, conn = [], []
    for _ in range(rounds):
        raw.append(raw_transfer_gbps(backend, num_blocks, BLOCK_LEN, scattered))
        conn.append(
            connector_transfer(
                backend, model, num_blocks, BLOCK_LEN, scattered, REPS, CONTIGUOUS_DESCS
            )
        )
    layout = "scattered" if scattered else "contiguous"
    descs = num_blocks if scattered else min(num_blocks, CONTIGUOUS_DESCS)
    raw_row = {
        "backend": backend,
        "layout": layout,
        "descs": descs,
        "gbps": round(statistics.median(raw), 2),
    }
    ratio = round(statistics.median(c["gbps"] / r for r, c in zip(raw, conn)), 2)
    conn_row = {
        "backend": backend,
        "layout": layout,
        "raw_gbps": raw_row["gbps"],
        **{key: round(statistics.median(c[key] for c in conn), 2) for key in conn[0]},
        "ratio": ratio,
        "meets_target": ratio >= TARGET_RATIO,
    }
    conn_row["descs"] = int(conn_row["descs"])
    conn_row["rounds_gbps"] = [
        [round(r, 2), round(c["gbps"], 2)] for r, c in zip(raw, conn)
    ]  # [raw, connector]
    conn_row["paired_meets_target"] = conn_row["paired_ratio"] >= TARGET_RATIO
    return raw_row, conn_row


def handover_row(backend: str, model: Path) -> dict:
    from kv_transfer_connector import handover

    row = {
        "backend": backend,
        **{k: round(v, 2) for k, v in handover(backend, model, REPS).items()},
    }
    row["meets_target"] = row["overhead_ms"] <= TARGET_OVERHEAD_MS
    return row


def print_tables(
    mib: int, rounds: int, raw: list[dict], conn: list[dict], hand: list[dict]
) -> None:
    print(f"{'backend':<8}{'layout':<12}{'descriptors':>12}{'GB/s (median)':>16}")
    for r in raw:
        print(f"{r['backend']:<8}{r['layout']:<12}{r['descs']:>12}{r['gbps']:>16.2f}")
    print(
        f"({mib} MiB of {BLOCK_LEN >> 10} KiB blocks per read, median of {REPS} reads, of {rounds} rounds)"
    )
    print()
    print(
        f"{'backend':<8}{'layout':<12}{'descs':>6}{'raw GB/s':>10}{'conn GB/s':>10}{'ratio':>7}{'':>4}"
        f"{'paired':>8}{'':>4}{'stall ms':>10}{'1st read ms':>13}{'handshake ms':>14}{'done seen ms':>14}"
    )
    ok = {True: "ok", False: "NO"}
    for c in conn:
        print(
            f"{c['backend']:<8}{c['layout']:<12}{c['descs']:>6}{c['raw_gbps']:>10.2f}{c['gbps']:>10.2f}"
            f"{c['ratio']:>7.2f}{ok[c['meets_target']]:>4}{c['paired_ratio']:>8.2f}"
            f"{ok[c['paired_meets_target']]:>4}{c['step_stall_ms']:>10.1f}{c['first_read_ms']:>13.1f}"
            f"{c['handshake_ms']:>14.1f}{c['done_seen_by_prefill_ms']:>14.1f}"
        )
    print(
        f"(connector: bind to finished_recving, median of {REPS} reads, of {rounds} rounds; ratio: connector / "
        f"raw GB/s of the same round, median over rounds; paired: raw / connector time of back-to-back reads "
        f"on the connector's own transport; target >= {TARGET_RATIO}. stall: longest start_load_kv + "
        f"get_finished call of a read; handshake: first read (with it) - median read, an estimate as noisy "
        f"as the reads; done seen: decode done -> prefill's finished_sending)"
    )
    if hand:
        print()
        print(
            f"{'backend':<8}{'handover ms':>13}{'transfer ms':>13}{'overhead ms':>13}{'':>4}{'min':>7}"
            f"{'baseline ms':>13}{'extra ms':>10}"
        )
        for h in hand:
            print(
                f"{h['backend']:<8}{h['handover_ms']:>13.1f}{h['transfer_ms']:>13.2f}{h['overhead_ms']:>13.1f}"
                f"{'ok' if h['meets_target'] else 'NO':>4}{h['overhead_min_ms']:>7.1f}{h['baseline_ms']:>13.1f}"
                f"{h['extra_ms']:>10.1f}"
            )
        print(
            f"(a {hand[0]['prompt_tokens']}-token prompt: prefill response -> decode's first streamed token; "
            f"transfer: decode's kv_transfer_seconds; overhead: handover - transfer, target <= "
            f"{TARGET_OVERHEAD_MS:.0f} ms; baseline: first token of a 1-token prompt on decode just before; "
            f"extra: overhead - baseline; medians of {REPS})"
        )


def main() -> None:
    global REPS
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=[*BACKENDS, "all"], default="all")
    parser.add_argument("--mib", type=int, default=64, help="bytes moved per read, in MiB")
    parser.add_argument(
        "--reps", type=int, default=REPS, help="timed reads (and handovers) per measurement"
    )
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="raw / connector alternations")
    parser.add_argument(
        "--skip-handover", action="store_true", help="no servers, transfer speed only"
    )
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    args = parser.parse_args()
    if args.reps < 1 or args.rounds < 1 or args.mib < 1:
        parser.error("--mib, --reps and --rounds must be positive")
    REPS = args.reps
    # A SIGTERM unwinds like an error, so every process started below is stopped.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    num_blocks = args.mib * (1 << 20) // BLOCK_LEN
    backends = BACKENDS if args.backend == "all" else (args.backend,)
    raw, conn, hand = [], [], []
    # Imported here, not at the top: the raw benchmark's owner processes import this file.
    from kv_transfer_connector import make_model

    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(Path(tmp))
        for backend in backends:
            for scattered in (True, False):
                raw_row, conn_row = compare(backend, model, num_blocks, scattered, args.rounds)
                raw.append(raw_row)
                conn.append(conn_row)
            if not args.skip_handover:
                hand.append(handover_row(backend, model))
    if not args.json:
        print_tables(args.mib, args.rounds, raw, conn, hand)
    print(
        json.dumps(
            {
                "benchmark": "kv_transfer",
                "mib": args.mib,
                "block_kib": BLOCK_LEN >> 10,
                "reps": args.reps,
                "rounds": args.rounds,
                "raw": raw,
                "connector": conn,
                "handover": hand,
            }
        )
    )


if __name__ == "__main__":
    main()
