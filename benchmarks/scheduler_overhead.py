"""Scheduler overhead per decode step: schedule() + update_from_output() with a fake runner.

Builds a Scheduler with N requests of ~100-token prompts, runs prefill steps until every
request is decoding, then times decode steps. Prints a table, then one JSON line.

    python benchmarks/scheduler_overhead.py [--num-requests 256] [--num-steps 1000] [--v2]
        [--phases] [--nano-vllm PATH]

--phases times the parts of a step in a second run (wrapping them costs time, so the totals
above come from a run without wrappers). --nano-vllm times nano-vllm's Scheduler.schedule() +
postprocess() on the same prompts, from a checkout at PATH (it needs numpy and xxhash).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import time
import types
from collections.abc import Callable

from pdserve.config import CacheConfig, SchedulerConfig
from pdserve.outputs import ModelRunnerOutput
from pdserve.request import Request
from pdserve.sampling_params import SamplingParams
from pdserve.scheduler import kv_cache_manager, scheduler
from pdserve.scheduler.output import SchedulerOutput
from pdserve.scheduler.scheduler import Scheduler

# The parts of a step --phases times: (owner, attribute, name in the table).
PHASES = (
    (kv_cache_manager.KVCacheManager, "allocate_slots", "  allocate_slots"),
    (scheduler, "build_scheduler_output", "  build output"),
    (scheduler.Scheduler, "_update_after_schedule", "  advance requests"),
    (scheduler, "apply_sampled_tokens", "  apply sampled tokens"),
)


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


def make_prompts(args: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(0)
    prompts = []
    for _ in range(args.num_requests):
        # Lengths spread over a block, so that block boundaries do not all fall in one step.
        prompt_len = args.prompt_len + rng.randrange(-args.block_size // 2, args.block_size // 2)
        prompts.append([rng.randrange(100, 32000) for _ in range(prompt_len)])
    return prompts


def sizes(args: argparse.Namespace) -> tuple[int, int]:
    """(max_model_len, num_blocks): room for every request's whole generation."""
    max_model_len = args.prompt_len + 2 * args.block_size + args.num_steps + 8
    return max_model_len, args.num_requests * (max_model_len // args.block_size + 1) + 1


def decoding_scheduler(
    args: argparse.Namespace, prompts: list[list[int]]
) -> tuple[Scheduler, SchedulerOutput, ModelRunnerOutput, int]:
    """A scheduler whose requests all decode; one decode step's runner output; prefill steps."""
    max_model_len, num_blocks = sizes(args)
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=args.num_requests, max_num_batched_tokens=8192),
        CacheConfig(block_size=args.block_size, enable_prefix_caching=not args.no_prefix_caching),
        max_model_len=max_model_len,
        num_blocks=num_blocks,
        use_v2_model_runner=args.v2,
    )
    params = SamplingParams(max_tokens=args.num_steps + 8, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        sched.add_request(Request(f"req-{i}", prompt, params, eos_token_id=2))
    num_prefill_steps = 0
    while sched.waiting or any(r.num_computed_tokens < r.num_tokens - 1 for r in sched.running):
        out = sched.schedule()
        sched.update_from_output(out, fake_runner_output(sched, out))
        num_prefill_steps += 1
    assert len(sched.running) == args.num_requests
    # The runner's output for a decode step is the same every step: build it once, so that
    # only the scheduler is timed.
    out = sched.schedule()
    runner_output = fake_runner_output(sched, out)
    sched.update_from_output(out, runner_output)
    return sched, out, runner_output, num_prefill_steps


def time_pdserve(
    args: argparse.Namespace, prompts: list[list[int]]
) -> tuple[dict[str, list[float]], int]:
    sched, out, runner_output, num_prefill_steps = decoding_scheduler(args, prompts)
    schedule_us, update_us, cpu_us = [], [], []
    gc.collect()
    gc.disable()  # a collection in one step would be noise, not scheduler cost
    try:
        for _ in range(args.num_steps):
            c0 = time.thread_time()
            t0 = time.perf_counter()
            out = sched.schedule()
            t1 = time.perf_counter()
            outputs = sched.update_from_output(out, runner_output)
            t2 = time.perf_counter()
            cpu_us.append((time.thread_time() - c0) * 1e6)
            assert len(outputs) == args.num_requests
            schedule_us.append((t1 - t0) * 1e6)
            update_us.append((t2 - t1) * 1e6)
    finally:
        gc.enable()
    total_us = [s + u for s, u in zip(schedule_us, update_us, strict=True)]
    # CPU time of this thread: on a shared machine, wall time also counts the waits for a core.
    phases = {
        "schedule": schedule_us,
        "update_from_output": update_us,
        "total": total_us,
        "total, CPU time": cpu_us,
    }
    return phases, num_prefill_steps


def time_phases(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, list[float]]:
    """Wall time of each part in PHASES per step, from a run with the parts wrapped."""
    sched, _, runner_output, _ = decoding_scheduler(args, prompts)
    spent: dict[str, float] = {name: 0.0 for _, _, name in PHASES}
    per_step: dict[str, list[float]] = {name: [] for _, _, name in PHASES}
    originals = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in PHASES]

    def timed(fn: Callable, name: str) -> Callable:
        def wrapper(*a: object, **kw: object) -> object:
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[name] += time.perf_counter() - t0

        return wrapper

    for (owner, attr, fn), (_, _, name) in zip(originals, PHASES, strict=True):
        setattr(owner, attr, timed(fn, name))
    gc.collect()
    gc.disable()
    try:
        for _ in range(args.num_steps):
            sched.update_from_output(sched.schedule(), runner_output)
            for name in spent:
                per_step[name].append(spent[name] * 1e6)
                spent[name] = 0.0
    finally:
        gc.enable()
        for owner, attr, fn in originals:
            setattr(owner, attr, fn)
    return per_step


def time_nano_vllm(path: str, args: argparse.Namespace, prompts: list[list[int]]) -> list[float]:
    """CPU time of nano-vllm's schedule() + postprocess() per decode step, same workload."""
    # nanovllm/__init__.py imports the model runner (torch, flash-attn): skip it.
    package = types.ModuleType("nanovllm")
    package.__path__ = [os.path.join(path, "nanovllm")]
    sys.modules["nanovllm"] = package
    from nanovllm.engine.scheduler import Scheduler as NanoScheduler
    from nanovllm.engine.sequence import Sequence
    from nanovllm.sampling_params import SamplingParams as NanoSamplingParams

    _, num_blocks = sizes(args)
    Sequence.block_size = args.block_size
    config = types.SimpleNamespace(
        max_num_seqs=args.num_requests,
        max_num_batched_tokens=8192,
        eos=2,
        kvcache_block_size=args.block_size,
        num_kvcache_blocks=num_blocks,
    )
    nano = NanoScheduler(config)
    params = NanoSamplingParams(max_tokens=args.num_steps + 8, ignore_eos=True)
    for prompt in prompts:
        nano.add(Sequence(prompt, params))
    while True:  # prefill steps, then one decode step
        seqs, is_prefill = nano.schedule()
        nano.postprocess(seqs, [11] * len(seqs), is_prefill)
        if not is_prefill:
            break
    token_ids = [11] * args.num_requests
    cpu_us = []
    gc.collect()
    gc.disable()
    try:
        for _ in range(args.num_steps):
            c0 = time.thread_time()
            seqs, is_prefill = nano.schedule()
            nano.postprocess(seqs, token_ids, is_prefill)
            cpu_us.append((time.thread_time() - c0) * 1e6)
            assert not is_prefill and len(seqs) == args.num_requests
    finally:
        gc.enable()
    return cpu_us


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=100)
    parser.add_argument("--num-steps", type=int, default=1000)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--v2", action="store_true", help="emit for model runner V2")
    parser.add_argument("--phases", action="store_true", help="also time the parts of a step")
    parser.add_argument("--nano-vllm", metavar="PATH", help="also time nano-vllm from PATH")
    args = parser.parse_args()

    prompts = make_prompts(args)
    phases, num_prefill_steps = time_pdserve(args, prompts)
    if args.phases:
        phases.update(time_phases(args, prompts))
    if args.nano_vllm:
        phases["nano-vllm, CPU time"] = time_nano_vllm(args.nano_vllm, args, prompts)

    print(
        f"{args.num_requests} decoding requests, {args.num_steps} steps after "
        f"{num_prefill_steps} prefill steps, runner {'V2' if args.v2 else 'V1'}, "
        f"prefix caching {'off' if args.no_prefix_caching else 'on'}"
    )
    print(f"{'phase':<24}{'median us':>12}{'mean us':>12}{'p99 us':>12}")
    for name, values in phases.items():
        median, mean = statistics.median(values), statistics.fmean(values)
        p99 = sorted(values)[int(0.99 * (len(values) - 1))]
        print(f"{name:<24}{median:>12.1f}{mean:>12.1f}{p99:>12.1f}")
    result = {
        "us_per_step": round(statistics.median(phases["total"]), 1),
        "us_per_step_mean": round(statistics.fmean(phases["total"]), 1),
        "cpu_us_per_step": round(statistics.median(phases["total, CPU time"]), 1),
        "schedule_us": round(statistics.median(phases["schedule"]), 1),
        "update_us": round(statistics.median(phases["update_from_output"]), 1),
        "num_requests": args.num_requests,
    }
    if args.nano_vllm:
        result["nano_vllm_cpu_us_per_step"] = round(
            statistics.median(phases["nano-vllm, CPU time"]), 1
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
