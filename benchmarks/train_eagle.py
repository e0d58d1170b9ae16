"""Distil an EAGLE head for the default model from its own generations, on this machine's CPU,
and write it in EAGLE's checkpoint layout (models/eagle.py reads it):

    .venv/bin/python benchmarks/train_eagle.py --output /tmp/pdserve-bench/eagle-smollm2
    .venv/bin/python benchmarks/spec_decode.py --method eagle --draft /tmp/pdserve-bench/eagle-smollm2

1. pdserve generates continuations of varied prompts with the default model (greedy, as the
   benchmark decodes, unless --temperature says otherwise; the prompts are composed here: no
   dataset is downloaded).
2. HF transformers gives the target's final hidden states (after its last norm, as pdserve's
   model returns them) over each sequence, in float32, on the model exported from the GGUF.
3. The head (fc over [embedding, hidden state], one Llama layer without its input norm, no
   final norm) starts as the identity on the hidden state (the target's last layer with its
   output projections zeroed, fc passing the hidden state through), and
   learns EAGLE's two losses with the target's embedding and LM head frozen: cross-entropy of
   the token two ahead, and a smooth L1 regression of the next hidden state.
4. The acceptance is then measured with benchmarks/spec_decode.py (its copy and open workloads
   are not among the training prompts).
"""

from __future__ import annotations

import argparse
import itertools
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spec_decode import EAGLE_HEAD  # noqa: E402
from vs_vllm import DEFAULT_CACHE_DIR, resolve_model  # noqa: E402

from pdserve import LLM, SamplingParams  # noqa: E402

TOPICS = (
    "the water cycle", "how bread rises", "the history of the bicycle", "volcanoes",
    "how a compiler works", "the rules of chess", "photosynthesis", "the moon landing",
    "a rainy day in a small town", "how to plant tomatoes", "the life of honeybees",
    "why the sky is blue", "a robot learning to paint", "the printing press",
    "how vaccines work", "a lost cat finding its way home", "the Roman empire",
    "how to make a cup of tea", "electric cars", "the ocean's deepest places",
    "a friendship between two old sailors", "how airplanes fly", "recycling plastic",
    "the first day at a new school", "black holes", "a market in the morning",
)  # fmt: skip
TEMPLATES = (
    "Write a short story about {}.\n",
    "Explain {} to a ten-year-old.\n",
    "Give five facts about {}.\n",
    "Write a poem about {}.\n",
    "Describe {} in detail.\n",
    "Question: What should everyone know about {}?\nAnswer:",
)


def generate(num_tokens: int, seed: int, temperature: float) -> list[list[int]]:
    """Prompt + continuation token ids of every composed prompt."""
    prompts = [t.format(topic) for t, topic in itertools.product(TEMPLATES, TOPICS)]
    random.Random(seed).shuffle(prompts)
    params = SamplingParams(temperature=temperature, max_tokens=num_tokens, seed=seed)
    with LLM(dtype="bfloat16") as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    return [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outputs]


def build_head(target: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Linear]:
    """(one Llama layer as a 1-layer LlamaModel without input or final norm, fc), started
    from the target's last layer with its two output projections zeroed and fc passing the
    hidden state through: the head starts as the identity on the target's normed hidden state
    (the target's own next-token logits), not as a layer whose output, scaled for the target's
    residual stream, swamps the LM head."""
    from transformers import LlamaModel

    config = target.config.__class__(**{**target.config.to_dict(), "num_hidden_layers": 1})
    head = LlamaModel(config)
    head.layers[0].load_state_dict(target.model.layers[-1].state_dict())
    with torch.no_grad():
        head.layers[0].self_attn.o_proj.weight.zero_()
        head.layers[0].mlp.down_proj.weight.zero_()
    head.layers[0].input_layernorm = torch.nn.Identity()
    head.norm = torch.nn.Identity()
    del head.embed_tokens
    hidden = config.hidden_size
    fc = torch.nn.Linear(2 * hidden, hidden, bias=False)
    with torch.no_grad():
        fc.weight.zero_()
        fc.weight[:, hidden:].copy_(torch.eye(hidden))
    return head, fc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--output", type=Path, default=EAGLE_HEAD)
    parser.add_argument("--tokens", type=int, default=256, help="generated per prompt")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="of the generations trained on (greedy: as benchmarks/spec_decode.py decodes)",
    )
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(
        resolve_model("default", "float32", DEFAULT_CACHE_DIR), dtype=torch.float32
    ).eval()
    target.requires_grad_(False)
    data = DEFAULT_CACHE_DIR / f"eagle-data-{args.tokens}-{args.seed}-{args.temperature}.pt"
    if data.exists():  # the generations and hidden states of an earlier run
        sequences, states = torch.load(data)
    else:
        start = time.perf_counter()
        sequences = generate(args.tokens, args.seed, args.temperature)
        print(f"{len(sequences)} sequences generated in {time.perf_counter() - start:.0f} s")
        start = time.perf_counter()
        with torch.no_grad():
            states = [
                target(torch.tensor([s]), output_hidden_states=True).hidden_states[-1][0]
                for s in sequences
            ]
        print(f"target hidden states in {time.perf_counter() - start:.0f} s")
        torch.save((sequences, states), data)

    head, fc = build_head(target)
    embed, lm_head = target.model.embed_tokens, target.lm_head
    params = [*head.parameters(), *fc.parameters()]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    order = list(range(len(sequences)))
    for epoch in range(args.epochs):
        random.Random(args.seed + epoch).shuffle(order)
        total = total_regression = correct = count = 0.0
        start = time.perf_counter()
        for i in order:
            tokens, h = torch.tensor(sequences[i]), states[i]
            # Position t reads the token at t + 1 and h_t; it predicts h_{t+1} and token t + 2.
            x = fc(torch.cat((embed(tokens[1:-1]), h[:-2]), dim=-1))
            out = head(inputs_embeds=x[None]).last_hidden_state[0]
            logits = lm_head(out)
            ce = F.cross_entropy(logits, tokens[2:])
            regression = F.smooth_l1_loss(out, h[1:-1])
            loss = ce + 0.1 * regression
            optimizer.zero_grad()
            loss.backward()
            # The head's output meets the LM head unnormalised: an unclipped step can blow it up.
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            total += float(ce) * len(out)
            total_regression += float(regression) * len(out)
            correct += float((logits.argmax(-1) == tokens[2:]).sum())
            count += len(out)
        print(
            f"epoch {epoch}: cross-entropy {total / count:.3f}, regression "
            f"{total_regression / count:.3f}, next-next token top-1 "
            f"{correct / count:.3f} ({time.perf_counter() - start:.0f} s)"
        )

    weights = {"fc.weight": fc.weight.detach().contiguous()}
    for name, tensor in head.layers[0].state_dict().items():
        weights[f"layers.0.{name}"] = tensor.contiguous()
    config = head.config
    config.architectures = ["EagleLlamaForCausalLM"]
    args.output.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(args.output)
    save_file(weights, args.output / "model.safetensors")
    print(f"EAGLE head written to {args.output}")


if __name__ == "__main__":
    main()
