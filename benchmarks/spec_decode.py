"""Speculative decoding on the default model, side by side with decoding without it: decode
tok/s at one request and at 8, on a copy-heavy workload (the model is asked to repeat a
paragraph it was given) and on open-ended writing, greedy, and the same writing sampled at
temperature 1 (seeded: little repeats, so little is accepted), EOS ignored; alternating rounds,
medians. With --vllm-python, vLLM's CPU build runs the same n-gram
config on the same prompts (its tok/s with and without, or why it fails).

    .venv/bin/python benchmarks/spec_decode.py [--rounds 3] [--output-len 128]
        [--vllm-python /work/vllm-venv/bin/python] [--method draft_model|eagle [--draft PATH]]

`--method draft_model` drafts with a model (`--draft`, by default the default model itself: a
mechanics check whose acceptance should be 1.0 and whose speed cannot win, the draft costing
what the target does); `--method eagle` with an EAGLE head (`--draft`, by default the one
benchmarks/train_eagle.py distils).

pdserve without speculation runs as it does by default (Model Runner V2, async scheduling);
with n-gram or a draft model, V1 (vLLM's rule), with EAGLE V2 (docs/spec_decode.md). A run's decode tok/s is its output
tokens over the time between generating 2 and output-len tokens a prompt (the prefill cancels).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vs_vllm import DEFAULT_CACHE_DIR, resolve_model, try_vllm  # noqa: E402

from pdserve import LLM, SamplingParams  # noqa: E402
from pdserve.models.loader.source import default_model_path  # noqa: E402

PARAGRAPH = (
    "The scheduler decides which requests run in each step. Running requests come first: each "
    "gets the tokens that take it to every token it has, as far as the budget lasts. Waiting "
    "requests are admitted with the rest, oldest first, while blocks and seats last. A request "
    "whose blocks run out preempts the newest running request, which computes its tokens again "
    "later."
)
STORY = "Write a short story about a lighthouse keeper who finds a map.\n"
WORKLOADS = {
    "copy": [f"Text: {PARAGRAPH}\n\nThe same text, word for word:\n"],
    "open": [STORY],
    # Sampled at temperature 1: the text rarely repeats itself, so drafts are rarely right and
    # speculation shows its cost (greedy decoding of this model repeats itself).
    "sampled": [STORY],
}
TEMPERATURE = {"sampled": 1.0}
EAGLE_HEAD = DEFAULT_CACHE_DIR / "eagle-smollm2"  # benchmarks/train_eagle.py writes it
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
         "prompt_lookup_max": 4}  # fmt: skip


def decode_tok_s(
    llm: LLM, prompts: list[str], output_len: int, temperature: float = 0.0
) -> tuple[float, float]:
    """(decode tok/s, end-to-end output tok/s, prefill included: vLLM's driver's measure)."""

    def run(max_tokens: int) -> float:
        params = SamplingParams(
            temperature=temperature, max_tokens=max_tokens, ignore_eos=True, seed=0
        )
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    run(2)  # warm-up: this batch's shapes
    full = run(output_len)
    num_tokens = len(prompts) * output_len
    return len(prompts) * (output_len - 2) / (full - run(2)), num_tokens / full


def vllm_tok_s(python: Path, prompts: list[str], args: argparse.Namespace, spec: bool) -> str:
    """vLLM's end-to-end output tok/s on `prompts`, or why it fails."""
    from transformers import AutoTokenizer

    model = resolve_model("default", "bfloat16", DEFAULT_CACHE_DIR)  # its HF folder, exported
    tokenizer = AutoTokenizer.from_pretrained(model)
    engine_args = {"model": str(model), "dtype": "bfloat16", "max_model_len": 2048}
    if spec:
        engine_args["speculative_config"] = NGRAM
    job = {
        "engine_args": engine_args,
        "prompts": [tokenizer.encode(p) for p in prompts],
        "output_len": args.output_len,
        "check_prompts": 0,
    }
    result = try_vllm(python, job)
    return result if isinstance(result, str) else f"{result['tok_s']:.1f} tok/s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--vllm-python", type=Path)
    parser.add_argument("--method", choices=("ngram", "draft_model", "eagle"), default="ngram")
    parser.add_argument(
        "--draft",
        help="the draft model (default: the default model) or EAGLE head (default: "
        "benchmarks/train_eagle.py's output)",
    )
    args = parser.parse_args()
    config = NGRAM
    if args.method != "ngram":
        default = default_model_path() if args.method == "draft_model" else EAGLE_HEAD
        config = {"method": args.method, "model": str(args.draft or default),
                  "num_speculative_tokens": 4 if args.method == "draft_model" else 3}  # fmt: skip
    results: dict[tuple[str, int, bool], list[tuple[float, float]]] = {}
    acceptance: dict[tuple[str, int], str] = {}
    for _ in range(args.rounds):
        for spec in (False, True):  # one engine alive at a time
            extra = {"speculative_config": config} if spec else {}
            with LLM(dtype="bfloat16", **extra) as llm:
                for workload, texts in WORKLOADS.items():
                    for batch in (1, 8):
                        stats = llm.engine_core.scheduler.spec_stats
                        before = (stats.num_accepted_tokens, stats.num_draft_tokens)
                        temperature = TEMPERATURE.get(workload, 0.0)
                        tok_s = decode_tok_s(llm, texts * batch, args.output_len, temperature)
                        results.setdefault((workload, batch, spec), []).append(tok_s)
                        accepted = stats.num_accepted_tokens - before[0]
                        drafted = stats.num_draft_tokens - before[1]
                        if spec:
                            acceptance[(workload, batch)] = f"{accepted / max(1, drafted):.2f}"
    print(f"decode tok/s, default model, bf16 (medians of {args.rounds}; load "
          f"{os.getloadavg()[0]:.1f}); acceptance: accepted / draft tokens")  # fmt: skip
    name = {"ngram": "ngram", "draft_model": "draft", "eagle": "eagle"}[args.method]
    print(f"{'workload':>9}{'batch':>6}{'no spec':>10}{name:>10}{'ratio':>7}{'accept':>8}"
          f"{'e2e no spec':>13}{'e2e ' + name:>11}")  # fmt: skip
    for workload in WORKLOADS:
        for batch in (1, 8):
            off, on = (
                [statistics.median(r[i] for r in results[(workload, batch, spec)]) for i in (0, 1)]
                for spec in (False, True)
            )
            print(
                f"{workload:>9}{batch:>6}{off[0]:>10.1f}{on[0]:>10.1f}{on[0] / off[0]:>7.2f}"
                f"{acceptance[(workload, batch)]:>8}{off[1]:>13.1f}{on[1]:>11.1f}"
            )
    if args.vllm_python and args.method == "ngram":
        for workload, texts in WORKLOADS.items():
            if workload in TEMPERATURE:
                continue  # vLLM's driver here decodes greedily
            for spec in (False, True):
                got = vllm_tok_s(args.vllm_python, texts, args, spec)
                print(f"vLLM CPU, {workload}, batch 1, {'ngram' if spec else 'no spec'}: {got}")


if __name__ == "__main__":
    main()
