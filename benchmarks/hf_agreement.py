"""How often pdserve's greedy answers equal HF transformers' on the same weights and dtype.

The default model (exported to an HF folder, as benchmarks/vs_vllm.py does) answers a set of
everyday chat prompts, greedy, --max-tokens tokens, in --dtype (bf16 by default): HF generates each
prompt alone; pdserve (`LLM.chat`, all prompts in one call) runs in a process of its own, and with
--baseline DIR also from another checkout (`git worktree add DIR <commit>`) for a before/after,
each worker reporting which checkout it imported.
Prints, per engine, how many answers equal HF's token for token and the first answers, then a
final JSON line.

Usage: .venv/bin/python benchmarks/hf_agreement.py [--dtype bfloat16] [--max-tokens 32]
       [--baseline DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPTS = [
    "What is the capital of France?",
    "What is the capital of Japan?",
    "Name three primary colors.",
    "Count to five.",
    "Write one sentence about the ocean.",
    "What is 12 times 12?",
    "Give me a synonym for happy.",
    "What do bees make?",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
    "What is the boiling point of water in Celsius?",
    "Suggest a name for a pet cat.",
    "How many days are in a week?",
    "What is the largest planet in our solar system?",
    "Write a haiku about autumn.",
    "What language is spoken in Brazil?",
    "Give one tip for sleeping better.",
    "What is photosynthesis, in one sentence?",
    "Who wrote Romeo and Juliet?",
    "List two fruits that are red.",
]


def pdserve_answers(model: str, dtype: str, max_tokens: int) -> list[list[int]]:
    import pdserve
    from pdserve import LLM, SamplingParams

    print(f"pdserve from {Path(pdserve.__file__).parent}", file=sys.stderr)
    with LLM(model=model, dtype=dtype, max_model_len=512) as llm:
        outs = llm.chat(
            [[{"role": "user", "content": p}] for p in PROMPTS],
            SamplingParams(max_tokens=max_tokens, temperature=0),
            use_tqdm=False,
        )
    return [list(o.outputs[0].token_ids) for o in outs]


def hf_answers(model: str, dtype: str, max_tokens: int) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()
    answers = []
    for prompt in PROMPTS:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt"
        )
        ids = ids["input_ids"] if not torch.is_tensor(ids) else ids
        with torch.inference_mode():
            out = hf.generate(ids, max_new_tokens=max_tokens, do_sample=False)
        answers.append(out[0, ids.shape[1] :].tolist())
    return answers


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--baseline", type=Path, help="a pdserve checkout to run as well")
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache/pdserve-bench")
    parser.add_argument("--pdserve-worker", help=argparse.SUPPRESS)  # a model folder
    parser.add_argument("--pdserve-root", help=argparse.SUPPRESS)  # the checkout it imports
    args = parser.parse_args()
    if args.pdserve_worker:
        sys.path.insert(0, args.pdserve_root)
        print(json.dumps(pdserve_answers(args.pdserve_worker, args.dtype, args.max_tokens)))
        return

    from transformers import AutoTokenizer
    from vs_vllm import resolve_model

    args.cache_dir.mkdir(parents=True, exist_ok=True)
    model = str(resolve_model("default", args.dtype, args.cache_dir))
    tokenizer = AutoTokenizer.from_pretrained(model)
    reference = hf_answers(model, args.dtype, args.max_tokens)
    here = Path(__file__).resolve().parents[1]
    checkouts = {
        "pdserve": here,
        **({"baseline": args.baseline.resolve()} if args.baseline else {}),
    }
    results = {}
    for name, checkout in checkouts.items():
        worker = [sys.executable, __file__, "--pdserve-worker", model, "--dtype", args.dtype]
        worker += ["--max-tokens", str(args.max_tokens), "--pdserve-root", str(checkout)]
        out = subprocess.run(worker, capture_output=True, text=True, check=True)
        answers = json.loads(out.stdout.strip().splitlines()[-1])
        same = [a == r for a, r in zip(answers, reference, strict=True)]
        results[name] = sum(same)
        source = next(line for line in out.stderr.splitlines() if line.startswith("pdserve from"))
        print(f"{name} ({source}): {sum(same)}/{len(PROMPTS)} answers equal to HF's ({args.dtype})")
        for prompt, answer, ok in list(zip(PROMPTS, answers, same, strict=True))[:3]:
            text = tokenizer.decode(answer, skip_special_tokens=True)
            print(f"  {'=' if ok else '!'} {prompt!r} -> {text!r}")
    print(
        json.dumps(
            {"benchmark": "hf_agreement", "dtype": args.dtype, "prompts": len(PROMPTS), **results}
        )
    )


if __name__ == "__main__":
    main()
