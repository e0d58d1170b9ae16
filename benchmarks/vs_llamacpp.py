"""pdserve against llama.cpp on the default model, offline and online (--part, default both).

Offline: decode tok/s and end-to-end output tok/s at 1, 16 and 64 sequences (64-token prompts,
128 tokens out), alternating rounds, medians. llama.cpp runs its three formats of the model: the
shipped Q4_1 file, and Q4_0 and bf16 files that its llama-quantize makes from it
(--allow-requantize: the Q4_0 weights are the Q4_1 ones requantized, the bf16 ones the Q4_1 ones
rounded). pdserve runs with its defaults (the Q4_1 blocks, `--quantization gguf` implied by the
file) and dequantized to bf16 (`--quantization none`). Both use 2 threads; llama.cpp runs in the
environment this script was started with (below).

Online: `pdserve serve` with its defaults (no quantization flag; PDSERVE_CPU_THREADS=2) against
`llama-server` on --server-format (default Q4_0, llama.cpp's fastest format here), run as

    llama-server -m FILE --host 127.0.0.1 --port P -t 2 -tb 2 --parallel N -kvu -c N*(128+T) \\
        --no-webui

(N: --slots, default --num-prompts, so that at saturation every request runs at once, as in
pdserve; -kvu: one KV cache shared by the slots, llama-server's default only when it picks the
slot count itself (per-slot caches about halved its throughput at saturation in a trial); -c:
room for N sequences of 128 prompt tokens, more than the longest built-in prompt, and T =
--max-tokens; its other settings are its defaults, prompt caching and continuous batching on.
It runs in the environment this script was started with, without the OpenMP settings pdserve
adds.)
Both are driven by `pdserve bench serve`'s load generator on /v1/completions (Poisson arrivals,
the same seed, the same built-in prompts, streamed, EOS ignored) at each of --request-rates
(default 4 and inf: all at once), --num-prompts prompts of --max-tokens tokens. Every run starts
a fresh server (so that no run finds the prompts of another in a cache), waits for /health,
sends one short warm-up request, benchmarks it and stops it with its whole process group, also
on Ctrl-C, SIGTERM or failure; logs go to --cache/logs. The engines alternate within each rate,
their order flipping from one round to the next. Prints a table per rate (output tok/s, TTFT
and ITL p50 / p99, medians over --rounds, and the ratio pdserve / llama.cpp) and a final JSON line.

llama.cpp, built in its own directory from the source in the llama-cpp-python sdist:

    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36
    tar xzf llama_cpp_python-0.3.36.tar.gz && cd llama_cpp_python-0.3.36/vendor/llama.cpp
    cmake -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_OPENSSL=OFF \\
        -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF \\
        -DLLAMA_BUILD_EXAMPLES=OFF
    cmake --build build -j2 --target llama-server llama-batched-bench llama-quantize

(the UI flags keep the server's build from downloading its web UI; about 9 minutes on 2 cores).

    .venv/bin/python benchmarks/vs_llamacpp.py --llamacpp DIR/build/bin [--rounds 3]
        [--part offline|online|both] [--server-format Q4_0] [--request-rates 4,inf]
        [--num-prompts 32] [--max-tokens 64] [--slots N]

Offline, llama.cpp's figures are llama-batched-bench's (S_TG t/s: decode; B * TG / T: end to
end); pdserve's decode tok/s is its output tokens over the time between generating 2 and 128
tokens a sequence (the prefill cancels).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

# The environment this script was started with: llama-server runs in it, not in what
# `import pdserve` adds for pdserve's own processes (GOMP_SPINCOUNT would also reach llama.cpp's
# OpenMP threads).
USER_ENV = dict(os.environ)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vs_vllm import stop_on_sigterm  # noqa: E402
from vs_vllm_serve import METRICS, bench_fresh_server  # noqa: E402

from pdserve import LLM, SamplingParams  # noqa: E402
from pdserve.entrypoints.bench_serve import (  # noqa: E402
    COMPLETIONS,
    PROMPTS,
    sample_prompts,
)
from pdserve.models.loader.source import default_model_path  # noqa: E402
from pdserve.utils import get_open_port  # noqa: E402

SEQUENCES = (1, 16, 64)
PROMPT_LEN, OUTPUT_LEN = 64, 128
FORMATS = ("Q4_1", "Q4_0", "BF16")
THREADS = 2
# Prompt tokens each llama-server slot holds beside --max-tokens: the longest built-in prompt
# is about 60 tokens, and a sequence that outgrows its slot would not get its --max-tokens.
SLOT_PROMPT_ROOM = 128


def llamacpp_files(bin_dir: Path, cache: Path) -> dict[str, Path]:
    """The model in each of llama.cpp's formats: the shipped Q4_1, the others quantized from it."""
    files = {"Q4_1": default_model_path()}
    cache.mkdir(parents=True, exist_ok=True)
    for fmt in FORMATS[1:]:
        path = cache / f"smollm2-135m-{fmt.lower()}.gguf"
        if not path.exists():
            subprocess.run(
                [str(bin_dir / "llama-quantize"), "--allow-requantize", str(files["Q4_1"]),
                 str(path), fmt, str(THREADS)],
                check=True, capture_output=True,
            )  # fmt: skip
        files[fmt] = path
    return files


def llamacpp_run(bin_dir: Path, model: Path) -> dict[int, tuple[float, float]]:
    """{sequences: (decode tok/s, end-to-end output tok/s)} from one llama-batched-bench run."""
    out = subprocess.run(
        [str(bin_dir / "llama-batched-bench"), "-m", str(model), "-c", "16384", "-b", "2048",
         "-ub", "512", "-npp", str(PROMPT_LEN), "-ntg", str(OUTPUT_LEN),
         "-npl", ",".join(map(str, SEQUENCES)), "-t", str(THREADS), "-tb", str(THREADS)],
        check=True, capture_output=True, text=True, env=USER_ENV,
    ).stdout  # fmt: skip
    figures = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 10 and re.fullmatch(r"\d+", cells[0]) and cells[0] == str(PROMPT_LEN):
            batch, total_s = int(cells[2]), float(cells[8])
            figures[batch] = (float(cells[7]), batch * OUTPUT_LEN / total_s)
    assert set(figures) == set(SEQUENCES), out
    return figures


def pdserve_run(llm: LLM, prompts: list[list[int]]) -> tuple[float, float]:
    """(decode tok/s, end-to-end output tok/s)."""

    def run(max_tokens: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - start

    run(2)  # this batch's shapes
    full = run(OUTPUT_LEN)
    decode = len(prompts) * (OUTPUT_LEN - 2) / (full - run(2))
    return decode, len(prompts) * OUTPUT_LEN / full


def cpu_name() -> str:
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if "model name" in line), "?")


def offline(args: argparse.Namespace) -> None:
    files = llamacpp_files(args.llamacpp, args.cache)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 49000) for _ in range(PROMPT_LEN)] for _ in range(64)]
    engines = {
        "pdserve default": LLM(max_model_len=1024, kv_cache_memory_bytes=2**30),
        "pdserve bf16": LLM(max_model_len=1024, kv_cache_memory_bytes=2**30, quantization="none"),
    }
    assert engines["pdserve default"].config.model_config.quantization == "gguf"
    results: dict[tuple[str, int], list[tuple[float, float]]] = {}
    try:
        for _ in range(args.rounds):  # alternating: each round runs every engine and format
            for fmt, path in files.items():
                for batch, figures in llamacpp_run(args.llamacpp, path).items():
                    results.setdefault((f"llama.cpp {fmt}", batch), []).append(figures)
            for name, llm in engines.items():
                for batch in SEQUENCES:
                    results.setdefault((name, batch), []).append(pdserve_run(llm, prompts[:batch]))
    finally:
        for llm in engines.values():
            llm.shutdown()
    names = [f"llama.cpp {f}" for f in FORMATS] + list(engines)
    print(f"offline: decode tok/s / end-to-end output tok/s, medians of {args.rounds} (load "
          f"{os.getloadavg()[0]:.1f}); {cpu_name()}, {THREADS} threads each")  # fmt: skip
    print(f"{'sequences':>9} " + " ".join(f"{n:>20}" for n in names) + "  default / best llama.cpp"
          "  default / bf16")  # fmt: skip
    for batch in SEQUENCES:
        medians = {
            n: tuple(statistics.median(r[i] for r in results[(n, batch)]) for i in (0, 1))
            for n in names
        }
        best = max(medians[f"llama.cpp {f}"][0] for f in FORMATS)
        cells = " ".join(f"{medians[n][0]:>9.1f} / {medians[n][1]:>8.1f}" for n in names)
        default = medians["pdserve default"][0]
        print(
            f"{batch:>9} {cells}  {default / best:.2f}x  {default / medians['pdserve bf16'][0]:.2f}x"
        )


def server_command(
    engine: str, model: Path, port: int, args: argparse.Namespace
) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) of one server."""
    if engine == "pdserve":
        argv = [sys.executable, "-m", "pdserve.entrypoints.cli", "serve", "--host", "127.0.0.1",
                "--port", str(port)]  # fmt: skip
        return argv, {**os.environ, "PDSERVE_CPU_THREADS": str(THREADS)}
    # One slot per request, and -kvu: with --parallel given, llama-server otherwise gives each
    # slot its own KV stream of -c / N tokens, which about halved its throughput at saturation.
    argv = [
        str(args.llamacpp / "llama-server"), "-m", str(model),
        "--host", "127.0.0.1", "--port", str(port),
        "-t", str(THREADS), "-tb", str(THREADS),
        "--parallel", str(args.slots), "-kvu",
        "-c", str(args.slots * (SLOT_PROMPT_ROOM + args.max_tokens)),
        "--no-webui",
    ]  # fmt: skip
    return argv, USER_ENV


def serve_run(engine: str, model: Path, rate: float, round_: int, args: argparse.Namespace) -> dict:
    """One benchmark of a freshly started server."""
    port = get_open_port()
    argv, env = server_command(engine, model, port, args)
    log = args.cache / "logs" / f"vs_llamacpp_serve-{engine}-{rate:g}-{round_}.log"
    load_args = (sample_prompts(args.num_prompts), rate, args.max_tokens, args.seed)
    warmup_prompt = max(PROMPTS, key=len)
    label = f"{engine} {rate:g} {round_}"
    return bench_fresh_server(argv, env, port, log, COMPLETIONS, warmup_prompt, load_args, label)


def online(args: argparse.Namespace) -> dict:
    """{rate: {engine: {metric: median}}}, each rate's table printed as it completes."""
    model = llamacpp_files(args.llamacpp, args.cache)[args.server_format]
    (args.cache / "logs").mkdir(parents=True, exist_ok=True)
    engines = ["pdserve", "llama.cpp"]
    keys = [key for _, key in METRICS] + ["startup_s"]
    medians: dict = {}
    for rate in args.request_rates:
        runs: dict[str, list[dict]] = {engine: [] for engine in engines}
        for round_ in range(1, args.rounds + 1):
            # The order flips each round, so that a drift in the machine's load favours neither.
            for engine in engines if round_ % 2 else engines[::-1]:
                result = serve_run(engine, model, rate, round_, args)
                print(
                    f"{engine} at {rate:g} req/s, round {round_}: healthy after "
                    f"{result['startup_s']:.1f} s, load {result['load']:.1f} at the start, "
                    f"{result['total_input_tokens']} prompt tokens, "
                    f"{result['total_output_tokens']} generated in {result['duration']:.1f} s",
                    flush=True,
                )
                runs[engine].append(result)
        medians[rate] = {
            e: {k: statistics.median(r[k] for r in runs[e]) for k in keys} for e in engines
        }
        print_online_table(rate, medians[rate], args)
    return medians


def print_online_table(rate: float, medians: dict, args: argparse.Namespace) -> None:
    pd, lc = medians["pdserve"], medians["llama.cpp"]
    llama = f"llama.cpp {args.server_format}"
    print(
        f"\nonline at {rate:g} req/s: {args.num_prompts} prompts x {args.max_tokens} tokens, "
        f"medians of {args.rounds} (load {os.getloadavg()[0]:.1f}); {cpu_name()}, "
        f"{THREADS} threads each"
    )
    print(f"{'':<14}{'pdserve':>10}{llama:>16}{'pdserve/llama.cpp':>19}")
    for label, key in [*METRICS, ("start-up s", "startup_s")]:
        ratio = pd[key] / lc[key] if lc[key] else float("nan")
        print(f"{label:<14}{pd[key]:>10.1f}{lc[key]:>16.1f}{ratio:>19.2f}")
    print(flush=True)


def online_summary(args: argparse.Namespace, medians: dict) -> dict:
    """The final JSON line: flat keys, `<rate>_<engine>_<metric>`."""
    summary = {
        "benchmark": "vs_llamacpp_serve",
        "server_format": args.server_format,
        "num_prompts": args.num_prompts,
        "max_tokens": args.max_tokens,
        "slots": args.slots,
        "rounds": args.rounds,
        "threads": THREADS,
    }
    for rate, by_engine in medians.items():
        name = "inf" if math.isinf(rate) else f"{rate:g}"  # JSON has no infinity
        for engine, figures in by_engine.items():
            for key, value in figures.items():
                summary[f"{name}_{engine.replace('.', '')}_{key}"] = round(value, 2)
        ratio = (
            by_engine["pdserve"]["output_throughput"] / by_engine["llama.cpp"]["output_throughput"]
        )
        summary[f"{name}_throughput_ratio"] = round(ratio, 3)
    return summary


def parse_rates(text: str) -> list[float]:
    rates = [float(r) for r in text.split(",")]
    if not all(r > 0 for r in rates):
        raise argparse.ArgumentTypeError(f"request rates must be > 0 (inf: all at once): {text}")
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--llamacpp", type=Path, required=True, help="llama.cpp's build/bin")
    parser.add_argument("--part", choices=["offline", "online", "both"], default="both")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cache", type=Path, default=Path("/tmp/pdserve-bench/llamacpp"))
    parser.add_argument("--server-format", choices=FORMATS, default="Q4_0")
    parser.add_argument("--request-rates", type=parse_rates, default=[4.0, math.inf])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--slots", type=int, default=None, help="default: --num-prompts")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.slots = args.slots or args.num_prompts
    stop_on_sigterm()
    if args.part in ("offline", "both"):
        offline(args)
    if args.part == "offline":
        return
    print(json.dumps(online_summary(args, online(args))))


if __name__ == "__main__":
    main()
