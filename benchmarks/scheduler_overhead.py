"""Scheduler overhead per decode step: schedule() + update_from_output() with a fake runner.

Builds a Scheduler with N requests of ~100-token prompts, runs prefill steps until every
request is decoding, then times decode steps. Prints a table, then one JSON line.

    python benchmarks/scheduler_overhead.py [--num-requests 256] [--num-steps 1000] [--v2]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time

from pdserve.config import CacheConfig, SchedulerConfig
from pdserve.outputs import ModelRunnerOutput
from pdserve.request import Request
from pdserve.sampling_params import SamplingParams
from pdserve.scheduler.output import SchedulerOutput
from pdserve.scheduler.scheduler import Scheduler


def fake_runner_output(
    scheduler: Scheduler, scheduler_output: SchedulerOutput
) -> ModelRunnerOutput:
    req_ids = list(scheduler_output.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        request = scheduler.requests[req_id]
        sampled.append([11] if request.num_computed_tokens >= request.num_tokens else [])
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
        sampled_token_ids=sampled,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=100)
    parser.add_argument("--num-steps", type=int, default=1000)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--v2", action="store_true", help="emit for model runner V2")
    args = parser.parse_args()

    rng = random.Random(0)
    max_model_len = args.prompt_len + 2 * args.block_size + args.num_steps + 8
    num_blocks = args.num_requests * (max_model_len // args.block_size + 1) + 1
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=args.num_requests, max_num_batched_tokens=8192),
        CacheConfig(block_size=args.block_size, enable_prefix_caching=not args.no_prefix_caching),
        max_model_len=max_model_len,
        num_blocks=num_blocks,
        use_v2_model_runner=args.v2,
    )
    params = SamplingParams(max_tokens=args.num_steps + 8, ignore_eos=True)
    for i in range(args.num_requests):
        # Lengths spread over a block, so that block boundaries do not all fall in one step.
        prompt_len = args.prompt_len + rng.randrange(-args.block_size // 2, args.block_size // 2)
        prompt = [rng.randrange(100, 32000) for _ in range(prompt_len)]
        scheduler.add_request(Request(f"req-{i}", prompt, params, eos_token_id=2))

    num_prefill_steps = 0
    while scheduler.waiting or any(
        r.num_computed_tokens < r.num_tokens - 1 for r in scheduler.running
    ):
        out = scheduler.schedule()
        scheduler.update_from_output(out, fake_runner_output(scheduler, out))
        num_prefill_steps += 1
    assert len(scheduler.running) == args.num_requests

    # The runner's output for a decode step is the same every step: build it once, so that
    # only the scheduler is timed.
    out = scheduler.schedule()
    runner_output = fake_runner_output(scheduler, out)
    scheduler.update_from_output(out, runner_output)

    schedule_us, update_us, cpu_us = [], [], []
    gc.collect()
    gc.disable()  # a collection in one step would be noise, not scheduler cost
    try:
        for _ in range(args.num_steps):
            c0 = time.thread_time()
            t0 = time.perf_counter()
            out = scheduler.schedule()
            t1 = time.perf_counter()
            outputs = scheduler.update_from_output(out, runner_output)
            t2 = time.perf_counter()
            cpu_us.append((time.thread_time() - c0) * 1e6)
            assert len(outputs) == args.num_requests
            schedule_us.append((t1 - t0) * 1e6)
            update_us.append((t2 - t1) * 1e6)
    finally:
        gc.enable()
    total_us = [s + u for s, u in zip(schedule_us, update_us, strict=True)]

    print(
        f"{args.num_requests} decoding requests, {args.num_steps} steps after "
        f"{num_prefill_steps} prefill steps, runner {'V2' if args.v2 else 'V1'}, "
        f"prefix caching {'off' if args.no_prefix_caching else 'on'}"
    )
    print(f"{'phase':<22}{'median us':>12}{'mean us':>12}{'p99 us':>12}")
    # CPU time of this thread: on a shared machine, wall time also counts the waits for a core.
    phases = (
        ("schedule", schedule_us),
        ("update_from_output", update_us),
        ("total", total_us),
        ("total, CPU time", cpu_us),
    )
    for name, values in phases:
        median, mean = statistics.median(values), statistics.fmean(values)
        p99 = sorted(values)[int(0.99 * (len(values) - 1))]
        print(f"{name:<22}{median:>12.1f}{mean:>12.1f}{p99:>12.1f}")
    print(
        json.dumps(
            {
                "us_per_step": round(statistics.median(total_us), 1),
                "us_per_step_mean": round(statistics.fmean(total_us), 1),
                "cpu_us_per_step": round(statistics.median(cpu_us), 1),
                "schedule_us": round(statistics.median(schedule_us), 1),
                "update_us": round(statistics.median(update_us), 1),
                "num_requests": args.num_requests,
            }
        )
    )


if __name__ == "__main__":
    main()
