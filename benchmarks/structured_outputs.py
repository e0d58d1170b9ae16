"""Structured outputs' cost per decode step at batch 32, side by side with the same batch
unconstrained, on one engine (LLM, default model unless --model).

Every request is held to 64 generated tokens (a JSON schema whose one string must be long,
so no constrained request can end early; unconstrained ones ignore EOS), and the decode step time is the difference between
a 65-token and a 1-token run over 64. Rows alternate, repeated --repeats times; medians. Also
times the two parts structured outputs add: the engine filling the bitmask (xgrammar, per
request) and the runner applying it to the logits; and the batch unconstrained without async
scheduling, since a constrained request does not overlap its steps (it waits for its token).

    python benchmarks/structured_outputs.py [--batch 32] [--repeats 3] [--model PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import xgrammar as xgr

from pdserve import LLM, SamplingParams
from pdserve.runners.sampler import apply_grammar_bitmask
from pdserve.sampling_params import StructuredOutputsParams
from pdserve.scheduler.output import GrammarBitmask
from pdserve.structured_output.grammar import compile_grammar

SCHEMA = {
    "type": "object",
    "properties": {"story": {"type": "string", "minLength": 600}},
    "required": ["story"],
}
PROMPT = "Write a long story about a lighthouse keeper, as JSON with one key, story."


def decode_step_ms(llm: LLM, batch: int, constrained: bool) -> float:
    so = StructuredOutputsParams(json=SCHEMA) if constrained else None

    def run(max_tokens: int) -> float:
        params = SamplingParams(
            temperature=0, max_tokens=max_tokens, ignore_eos=not constrained, structured_outputs=so
        )
        # Distinct prompts: no request finds another's blocks cached mid-run.
        prompts = [f"{i}. {PROMPT}" for i in range(batch)]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        assert all(len(o.outputs[0].token_ids) == max_tokens for o in outputs)
        return elapsed

    return (run(65) - run(1)) / 64 * 1e3


def parts_us(llm: LLM, batch: int) -> tuple[float, float]:
    """xgrammar filling `batch` bitmask rows, and the runner applying them (CPU logits)."""
    mc = llm.config.model_config
    info = xgr.TokenizerInfo.from_huggingface(
        llm.get_tokenizer(), vocab_size=mc.vocab_size, stop_token_ids=mc.eos_token_ids
    )
    compiled = compile_grammar(xgr.GrammarCompiler(info), StructuredOutputsParams(json=SCHEMA))
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
    for m in matchers:
        assert m.accept_string('{"story": "Once')
    bitmask = xgr.allocate_token_bitmask(batch, mc.vocab_size)
    n = 200
    start = time.perf_counter()
    for _ in range(n):
        for row, m in enumerate(matchers):
            m.fill_next_token_bitmask(bitmask, row)
    fill = (time.perf_counter() - start) / n * 1e6
    grammar = GrammarBitmask([str(i) for i in range(batch)], bitmask.numpy().tobytes())
    logits = torch.randn(batch, mc.vocab_size, dtype=mc.torch_dtype)
    ids = [str(i) for i in range(batch)]
    start = time.perf_counter()
    for _ in range(n):
        apply_grammar_bitmask(logits.clone(), grammar, ids)
    apply = (time.perf_counter() - start) / n * 1e6
    return fill, apply


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default=None)
    parser.add_argument("--max-model-len", type=int, default=512)
    args = parser.parse_args()
    kwargs = {"model": args.model} if args.model else {}
    results: dict[str, list[float]] = {"unconstrained": [], "json schema": []}
    with LLM(max_model_len=args.max_model_len, max_num_seqs=args.batch, **kwargs) as llm:
        decode_step_ms(llm, args.batch, True)  # warm up (and compile the schema once)
        for _ in range(args.repeats):
            results["unconstrained"].append(decode_step_ms(llm, args.batch, False))
            results["json schema"].append(decode_step_ms(llm, args.batch, True))
        fill, apply = parts_us(llm, args.batch)
    # A constrained request waits for its token in flight: its steps no longer overlap the
    # next one's scheduling. This row is that loss alone.
    sync = LLM(
        max_model_len=args.max_model_len, max_num_seqs=args.batch, async_scheduling=False, **kwargs
    )
    with sync:
        decode_step_ms(sync, args.batch, False)
        sync_ms = statistics.median(
            decode_step_ms(sync, args.batch, False) for _ in range(args.repeats)
        )
    free = statistics.median(results["unconstrained"])
    held = statistics.median(results["json schema"])
    print(f"decode step at batch {args.batch} (median of {args.repeats}):")
    print(f"  unconstrained  {free:7.2f} ms")
    print(f"  json schema    {held:7.2f} ms   ({held - free:+.2f} ms, x{held / free:.3f})")
    print(f"  of which: bitmask fill {fill:.0f} us (engine), apply {apply:.0f} us (runner)")
    print(f"  unconstrained, sync scheduling {sync_ms:7.2f} ms (no step overlap)")
    print(
        json.dumps(
            {
                "batch": args.batch,
                "unconstrained_ms": round(free, 3),
                "json_schema_ms": round(held, 3),
                "ratio": round(held / free, 4),
                "fill_us": round(fill, 1),
                "apply_us": round(apply, 1),
                "unconstrained_sync_ms": round(sync_ms, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
