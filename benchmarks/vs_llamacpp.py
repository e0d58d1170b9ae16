"""pdserve against llama.cpp on the default model, offline: decode tok/s and end-to-end output
tok/s at 1, 16 and 64 sequences (64-token prompts, 128 tokens out), alternating rounds, medians.
llama.cpp runs its three formats of the model: the shipped Q4_1 file, and Q4_0 and bf16 files
that its llama-quantize makes from it (--allow-requantize: the Q4_0 weights are the Q4_1 ones
requantized, the bf16 ones the Q4_1 ones rounded). pdserve runs dequantized to bf16 (its
default) and with `--quantization gguf` (the Q4_1 blocks). Both use 2 threads.

llama.cpp, built in its own directory from the source in the llama-cpp-python sdist:

    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36
    tar xzf llama_cpp_python-0.3.36.tar.gz && cd llama_cpp_python-0.3.36/vendor/llama.cpp
    cmake -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_OPENSSL=OFF \\
        -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF \\
        -DLLAMA_BUILD_EXAMPLES=OFF
    cmake --build build -j2 --target llama-server llama-batched-bench llama-quantize

(the UI flags keep the server's build from downloading its web UI; about 9 minutes on 2 cores).

    .venv/bin/python benchmarks/vs_llamacpp.py --llamacpp DIR/build/bin [--rounds 3]

llama.cpp's figures are llama-batched-bench's (S_TG t/s: decode; B * TG / T: end to end);
pdserve's decode tok/s is its output tokens over the time between generating 2 and 128 tokens
a sequence (the prefill cancels). The online comparison (llama-server at 4 req/s and at
saturation) is not in this script yet.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve import LLM, SamplingParams  # noqa: E402
from pdserve.models.loader.source import default_model_path  # noqa: E402

SEQUENCES = (1, 16, 64)
PROMPT_LEN, OUTPUT_LEN = 64, 128
FORMATS = ("Q4_1", "Q4_0", "BF16")
THREADS = 2


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
        check=True, capture_output=True, text=True,
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--llamacpp", type=Path, required=True, help="llama.cpp's build/bin")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cache", type=Path, default=Path("/tmp/pdserve-bench/llamacpp"))
    args = parser.parse_args()
    files = llamacpp_files(args.llamacpp, args.cache)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 49000) for _ in range(PROMPT_LEN)] for _ in range(64)]
    engines = {
        "pdserve bf16": LLM(max_model_len=1024, kv_cache_memory_bytes=2**30),
        "pdserve Q4_1": LLM(max_model_len=1024, kv_cache_memory_bytes=2**30, quantization="gguf"),
    }
    results: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for _ in range(args.rounds):  # alternating: each round runs every engine and format
        for fmt, path in files.items():
            for batch, figures in llamacpp_run(args.llamacpp, path).items():
                results.setdefault((f"llama.cpp {fmt}", batch), []).append(figures)
        for name, llm in engines.items():
            for batch in SEQUENCES:
                results.setdefault((name, batch), []).append(pdserve_run(llm, prompts[:batch]))
    for llm in engines.values():
        llm.shutdown()
    names = [f"llama.cpp {f}" for f in FORMATS] + list(engines)
    cpu = next(
        (line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if "model name" in line),
        "?",
    )
    print(f"decode tok/s / end-to-end output tok/s, medians of {args.rounds} (load "
          f"{os.getloadavg()[0]:.1f}); {cpu}, {THREADS} threads each")  # fmt: skip
    print(f"{'sequences':>9} " + " ".join(f"{n:>20}" for n in names) + "  Q4_1 / best llama.cpp")
    for batch in SEQUENCES:
        medians = {
            n: tuple(statistics.median(r[i] for r in results[(n, batch)]) for i in (0, 1))
            for n in names
        }
        best = max(medians[f"llama.cpp {f}"][0] for f in FORMATS)
        cells = " ".join(f"{medians[n][0]:>9.1f} / {medians[n][1]:>8.1f}" for n in names)
        print(f"{batch:>9} {cells}  {medians['pdserve Q4_1'][0] / best:.2f}x")


if __name__ == "__main__":
    main()
