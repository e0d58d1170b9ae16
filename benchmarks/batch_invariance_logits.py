"""A model's logits for a request alone and inside batches of others, compared bit for bit, with
PDSERVE_BATCH_INVARIANT on and then off: the GPU check's proof of the switch.

The model runs directly (no engine) on --device, on a paged KV cache like the engine's. Each of
--probes requests (a prompt of 20..400 tokens, then --decodes decode steps) runs alone; then
again with every step inside a crowd: decodes of --background requests whose contexts are
20..1500 tokens long, and a new prompt of 1..300 tokens every other step, the probe at a random
place. A probe counts as identical when all its logits (its last prompt token's and each
decode's) are the same bits. The switch is read at every kernel call, so one process runs both
settings. On CPU the kernels are batch invariant either way.

Usage: python benchmarks/batch_invariance_logits.py [--model default|tiny|PATH] [--device cuda]
       [--dtype bfloat16] [--probes 8] [--decodes 4] [--background 24]
Prints a table and a final JSON line; exits 1 unless every probe is identical with the switch on.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.kernels.linear import pack_linear_weights  # noqa: E402
from pdserve.models.loader import (  # noqa: E402
    default_model_path,
    load_hf_config,
    load_model,
    resolve_model_source,
)
from tests.utils.paged_batch import PagedKVCache, build_step, make_kv_cache  # noqa: E402

BLOCK_SIZE = 16


@torch.inference_mode()
def run_step(
    model: torch.nn.Module, kv: PagedKVCache, step: list[tuple[str, list[int]]]
) -> list[torch.Tensor]:
    """tests/utils/paged_batch.run_step on the model's device."""
    device = kv.cache.device
    input_ids, positions, md = build_step(kv, step)
    for name in ("query_start_loc", "seq_lens", "block_table", "slot_mapping"):
        setattr(md, name, getattr(md, name).to(device))
    hidden_states = model(input_ids.to(device), positions.to(device), kv.layer_caches, md)
    return list(model.compute_logits(hidden_states).split([len(t) for _, t in step]))


def probe_logits(
    model: torch.nn.Module, kv: PagedKVCache, name: str, steps: list[list[int]], crowds: list
) -> list[torch.Tensor]:
    """The probe's logits at its prompt's last token and at each decode; its step i runs inside
    crowds[i] = (other requests, the probe's place among them)."""
    out = []
    for tokens, (crowd, at) in zip(steps, crowds, strict=True):
        step = [*crowd[:at], (name, tokens), *crowd[at:]]
        out.append(run_step(model, kv, step)[at][-1])
    return out


def compare(model: torch.nn.Module, vocab_size: int, args: argparse.Namespace) -> dict:
    rng = random.Random(0)
    kv = make_kv_cache(model.config, num_blocks=2048, block_size=BLOCK_SIZE, dtype=args.dtype)
    kv.cache = kv.cache.to(args.device)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, vocab_size) for _ in range(n)]

    background = [f"bg{i}" for i in range(args.background)]
    for i in range(0, len(background), 4):  # their prompts, a few at a time
        run_step(
            model, kv, [(name, tokens(rng.randint(20, 1500))) for name in background[i : i + 4]]
        )
    identical, max_diff = 0, 0.0
    for p in range(args.probes):
        steps = [tokens(rng.randint(20, 400))] + [tokens(1) for _ in range(args.decodes)]
        crowds = []
        for i in range(len(steps)):
            decodes = rng.sample(background, rng.randint(1, len(background)))
            crowd = [(name, tokens(1)) for name in decodes]
            if i % 2 == 0:
                crowd.append((f"new{p}-{i}", tokens(rng.randint(1, 300))))
            crowds.append((crowd, rng.randint(0, len(crowd))))
        alone = probe_logits(model, kv, f"alone{p}", steps, [([], 0)] * len(steps))
        crowded = probe_logits(model, kv, f"crowded{p}", steps, crowds)
        pairs = list(zip(alone, crowded, strict=True))
        identical += all(torch.equal(a, b) for a, b in pairs)
        max_diff = max(max_diff, *((a - b).abs().max().item() for a, b in pairs))
    return {"identical": identical, "probes": args.probes, "max_abs_diff": max_diff}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="default", help="default, tiny or a model path")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--probes", type=int, default=8)
    parser.add_argument("--decodes", type=int, default=4)
    parser.add_argument("--background", type=int, default=24)
    args = parser.parse_args()
    args.dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model
        if path == "default":
            path = str(default_model_path())
        elif path == "tiny":
            from tests.utils.tiny_models import make_tiny_model

            path = str(make_tiny_model("llama", Path(tmp) / "tiny"))
        source = resolve_model_source(path)
        config = load_hf_config(source)
        model = load_model(config, source, args.dtype, args.device)
    pack_linear_weights(model)  # as the runners do (CPU only)
    results = {}
    print(f"{'PDSERVE_BATCH_INVARIANT':<26}{'identical alone vs crowd':>26}{'max |diff|':>12}")
    for switch in ("1", "0"):
        os.environ["PDSERVE_BATCH_INVARIANT"] = switch
        result = compare(model, config.vocab_size, args)
        results[switch] = result
        same = f"{result['identical']}/{result['probes']}"
        print(f"{switch:<26}{same:>26}{result['max_abs_diff']:>12.3g}", flush=True)
    all_ok = results["1"]["identical"] == args.probes
    on, off = results["1"], results["0"]
    summary = f"on {on['identical']}/{args.probes}, off {off['identical']}/{args.probes}"
    print(
        json.dumps(
            {
                "benchmark": "batch_invariance_logits",
                "device": args.device,
                "dtype": str(args.dtype),
                "identical": summary,
                "all_ok": all_ok,
                "on": on,
                "off": off,
            }
        )
    )
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
