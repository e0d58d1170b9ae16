"""One engine's side of benchmarks/vs_vllm.py, in that engine's own Python.

Usage: PYTHON benchmarks/vs_vllm_driver.py JOB.json RESULT.json

JOB.json names the engine ("pdserve" or "vllm"), its engine arguments (vLLM's names, which
pdserve shares), the prompt token ids, the output length, how many prompts' tokens to return,
and `launched_at`: the wall-clock time at which the parent started this process. The driver
builds the engine, runs one short warm-up generation (64 prompt tokens, 4 generated), then times one greedy generation of every
prompt (exactly `output_len` tokens each, EOS ignored), and writes RESULT.json. It imports only
the engine it runs, so it works in vLLM's virtual environment, which has no pdserve.

Start-up is measured from `launched_at` (interpreter start and imports included) to the engine's
constructor returning; the warm-up and the timed generation are measured apart from it.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

WARMUP_TOKENS = 4
# The warm-up prompt is this long because vLLM 0.32's CPU attention runs AMX tiles, and a worker
# whose first forward covers only a few tokens dies of SIGILL: nothing has asked the kernel for
# AMX yet (oneDNN does on its first large enough bf16 matmul).
WARMUP_PROMPT_LEN = 64


def run(job: dict) -> dict:
    if job["engine"] == "vllm":
        import vllm
        from vllm import LLM, SamplingParams

        version, source = vllm.__version__, vllm.__file__
    else:
        # This checkout, or the one a --baseline run names.
        sys.path.insert(0, job.get("pdserve_root") or str(Path(__file__).resolve().parents[1]))
        import pdserve
        from pdserve import LLM, SamplingParams

        version, source = pdserve.__version__, pdserve.__file__
    imported_at = time.time()
    llm = LLM(**job["engine_args"])
    ready_at = time.time()

    prompts = [{"prompt_token_ids": ids} for ids in job["prompts"]]
    warmup_ids = [t for ids in job["prompts"] for t in ids][:WARMUP_PROMPT_LEN]
    start = time.perf_counter()
    llm.generate(
        [{"prompt_token_ids": warmup_ids}],
        SamplingParams(temperature=0, max_tokens=WARMUP_TOKENS),
        use_tqdm=False,
    )
    warmup_s = time.perf_counter() - start

    params = SamplingParams(temperature=0, max_tokens=job["output_len"], ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    generate_s = time.perf_counter() - start
    token_ids = [list(o.outputs[0].token_ids) for o in outputs]
    num_tokens = sum(len(ids) for ids in token_ids)
    if job["engine"] == "pdserve":
        llm.shutdown()  # vLLM shuts its engine down at exit
    return {
        "engine": job["engine"],
        "version": version,
        "source": str(Path(source).parent),  # which checkout or environment ran
        "startup_s": ready_at - job["launched_at"],
        "import_s": imported_at - job["launched_at"],
        "warmup_s": warmup_s,
        "generate_s": generate_s,
        "num_tokens": num_tokens,
        "tok_s": num_tokens / generate_s,
        "token_ids": token_ids[: job["check_prompts"]],
    }


def main() -> None:
    job_path, result_path = sys.argv[1:3]
    job = json.loads(Path(job_path).read_text())
    Path(result_path).write_text(json.dumps(run(job)))


if __name__ == "__main__":  # vLLM starts its engine processes with spawn, which re-imports this
    main()
