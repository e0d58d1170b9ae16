"""Executor control-plane cost: broadcast a 256-request decode SchedulerOutput to N workers and
collect their outputs, with a model-free worker; also the wake-up latency after idling and the
CPU an idle executor uses.

Usage: python benchmarks/executor_overhead.py [--model PATH] [--tp 2] [--num-reqs 256] [--steps 500]
Prints a table and a final JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.config import EngineConfig  # noqa: E402
from pdserve.executor.multiproc import MultiprocExecutor  # noqa: E402
from pdserve.executor.worker import Worker  # noqa: E402
from pdserve.outputs import ModelRunnerOutput  # noqa: E402
from pdserve.scheduler.output import CachedRequestData, SchedulerOutput  # noqa: E402


class NoOpWorker(Worker):
    """Answers every step with one token per scheduled request, running no model."""

    def load_model(self) -> None:
        return None

    def determine_num_blocks(self) -> int:
        return 1024

    def initialize_kv_cache(self, num_blocks: int) -> None:
        return None

    def now(self) -> float:
        """The worker's wall clock when it runs the call: the start of a step, seen from a rank."""
        return time.time()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        req_ids = list(scheduler_output.num_scheduled_tokens)
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=[[7] for _ in req_ids])


def decode_step(num_reqs: int, step: int) -> SchedulerOutput:
    """What the scheduler emits for num_reqs running decodes (a new block every 16 steps)."""
    req_ids = [f"req-{i}" for i in range(num_reqs)]
    new_blocks = [[1000 + i] if (step + i) % 16 == 0 else None for i in range(num_reqs)]
    cached = CachedRequestData(
        req_ids=req_ids,
        resumed_req_ids=set(),
        all_token_ids={},
        new_block_ids=new_blocks,
        num_computed_tokens=[100 + step] * num_reqs,
        num_output_tokens=[step] * num_reqs,
    )
    return SchedulerOutput([], cached, {r: 1 for r in req_ids}, num_reqs, set(), None)


def cpu_seconds(pids: list[int]) -> float:
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime + stime, all threads
    return total / ticks


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="any model folder (only its config is read)")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--num-reqs", type=int, default=256)
    parser.add_argument("--steps", type=int, default=500)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from tests.utils.tiny_models import make_tiny_model

            model = str(make_tiny_model("llama", Path(tmp) / "tiny"))
        config = EngineConfig.from_engine_args(
            model=model,
            tensor_parallel_size=args.tp,
            distributed_executor_backend="mp",
            max_num_seqs=args.num_reqs,
            max_num_batched_tokens=max(2048, args.num_reqs),
            worker_cls="benchmarks.executor_overhead:NoOpWorker",
            async_scheduling=False,
        )
        executor = MultiprocExecutor(config)
        try:
            steps = [decode_step(args.num_reqs, s) for s in range(args.steps)]
            for so in steps[:20]:
                executor.execute_model(so)
            times = []
            for so in steps:
                start = time.perf_counter()
                out = executor.execute_model(so)
                times.append((time.perf_counter() - start) * 1e6)
                assert len(out.req_ids) == args.num_reqs

            pids = [os.getpid()] + [w.proc.pid for w in executor.workers]
            time.sleep(1.0)  # let every loop fall back from spinning to blocking
            before = cpu_seconds(pids)
            time.sleep(5.0)
            idle_pct = (cpu_seconds(pids) - before) / 5.0 * 100
            wake, start_delay = [], []
            for _ in range(5):
                time.sleep(1.0)
                start = time.perf_counter()
                executor.execute_model(steps[0])
                wake.append((time.perf_counter() - start) * 1e3)
                time.sleep(1.0)
                sent = time.time()
                started = executor.collective_rpc("now")  # every rank's start time
                start_delay.append((max(started) - sent) * 1e3)
        finally:
            executor.shutdown()

    median, p99 = statistics.median(times), sorted(times)[int(len(times) * 0.99)]
    print(f"{'measure':<44}{'value':>12}")
    print(f"{'step broadcast + collect, median (us)':<44}{median:>12.1f}")
    print(f"{'step broadcast + collect, p99 (us)':<44}{p99:>12.1f}")
    print(f"{'idle CPU, engine + workers (% of a core)':<44}{idle_pct:>12.2f}")
    print(f"{'first step after 1 s idle, median (ms)':<44}{statistics.median(wake):>12.2f}")
    print(
        f"{'  of which until every rank started (ms)':<44}{statistics.median(start_delay):>12.2f}"
    )
    print(f"({args.num_reqs} decode requests, TP={args.tp}, model-free workers)")
    print(
        json.dumps(
            {
                "benchmark": "executor_overhead",
                "tp": args.tp,
                "num_reqs": args.num_reqs,
                "us_per_step": round(median, 1),
                "us_per_step_p99": round(p99, 1),
                "idle_cpu_pct": round(idle_pct, 2),
                "wake_ms": round(statistics.median(wake), 2),
                "start_after_idle_ms": round(statistics.median(start_delay), 2),
            }
        )
    )


if __name__ == "__main__":
    main()
