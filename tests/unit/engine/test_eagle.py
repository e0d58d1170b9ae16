"""EAGLE (runners V1 and V2): greedy output with an EAGLE head is the target's greedy output, in batches,
with chunked prefill and preemption; and every guess the runner makes is the one an EAGLE head
written here from its definition makes (HF's target hidden states, HF's Llama layer over
fc(concat(embedding, hidden)), the first layer without its input norm, no final norm, the
target's LM head), pass after pass. Pools full after."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, LlamaModel

from pdserve import LLM
from pdserve.config import EngineConfig
from pdserve.scheduler.scheduler import Scheduler
from tests.unit.engine.test_correctness import assert_pool_full, reference, run
from tests.unit.engine.test_spec_decode import ASYNC, copy_heavy_prompts, record_filled_drafts
from tests.utils.tiny_models import load_hf_model, make_tiny_eagle_head, make_tiny_model

K = 3


def eagle(head: Path) -> dict:
    return {"method": "eagle", "model": str(head), "num_speculative_tokens": K}


class ReferenceEagle:
    """The head from its definition, on HF's modules, without a KV cache."""

    def __init__(self, target_path: str, head_path: Path) -> None:
        self.target = load_hf_model(Path(target_path))
        config = AutoConfig.from_pretrained(head_path)
        self.layers = LlamaModel(config).eval()
        weights = load_file(head_path / "model.safetensors")
        self.fc = weights.pop("fc.weight")
        missing, _ = self.layers.load_state_dict(weights, strict=False)
        assert missing == ["layers.0.input_layernorm.weight", "norm.weight"]
        self.layers.layers[0].input_layernorm = torch.nn.Identity()
        self.layers.norm = torch.nn.Identity()

    @torch.no_grad()
    def guesses(self, tokens: list[int], k: int) -> list[int]:
        """The head's k guesses after `tokens` (the last one's target hidden state unknown)."""
        hidden = self.target(torch.tensor([tokens[:-1]]), output_hidden_states=True)
        states = hidden.hidden_states[-1][0]  # after the final norm, as pdserve's model returns
        embed = self.target.model.embed_tokens
        shifted = torch.tensor(tokens[1:])
        out: list[int] = []
        for _ in range(k):
            x = torch.cat((embed(shifted), states), dim=-1) @ self.fc.T
            h = self.layers(inputs_embeds=x[None]).last_hidden_state[0]
            guess = int(self.target.lm_head(h[-1]).argmax())
            out.append(guess)
            shifted = torch.cat((shifted, torch.tensor([guess])))
            states = torch.cat((states, h[-1:]))
        return out


@pytest.mark.parametrize(
    "engine",
    [{}, {"max_num_batched_tokens": 16, "max_num_seqs": 4}, {"num_gpu_blocks_override": 12}, ASYNC],
    ids=["batched", "chunked", "preempting", "async"],
)
@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_eagle_guesses_are_the_heads_and_tokens_the_targets(
    tiny_model, monkeypatch, tmp_path, engine, runner
) -> None:
    monkeypatch.delenv("PDSERVE_USE_V2_MODEL_RUNNER", raising=False)
    if runner == "v1":
        monkeypatch.setenv("PDSERVE_USE_V2_MODEL_RUNNER", "0")
    path = tiny_model("llama")
    head = make_tiny_eagle_head(tmp_path / "eagle")
    proposals: list[tuple[list[int], list[int]]] = []
    paused: list[str] = []
    update = Scheduler.update_from_output

    def recording(self, scheduler_output, model_runner_output):  # type: ignore[no-untyped-def]
        # A request whose next step is paused (its drafts missed) gets no guesses.
        paused.extend(scheduler_output.draft_paused_req_ids or ())
        guessed = model_runner_output.draft_token_ids or {}
        assert not guessed.keys() & (scheduler_output.draft_paused_req_ids or set())
        outputs = update(self, scheduler_output, model_runner_output)
        applied = {o.request_id for o in outputs}  # not the steps of requests preempted since
        for req_id, guesses in (model_runner_output.draft_token_ids or {}).items():
            request = self.requests.get(req_id)
            if request is not None and req_id in applied:
                proposals.append((list(request.all_token_ids), guesses))
        return outputs

    monkeypatch.setattr(Scheduler, "update_from_output", recording)
    filled = record_filled_drafts(monkeypatch)
    with LLM(
        model=path, dtype="float32", max_model_len=256, speculative_config=eagle(head), **engine
    ) as llm:
        assert llm.config.use_v2_model_runner is (runner == "v2")  # V2 by default
        prompts = copy_heavy_prompts(llm.config.model_config.vocab_size)
        assert run(llm, prompts) == reference(path, prompts)
        assert llm.engine_core.scheduler.spec_stats.num_drafts > 0
        assert (sum(filled) > 0) is (engine is ASYNC)  # the runner's guesses in flight
        assert_pool_full(llm)
    ref = ReferenceEagle(path, head)
    assert len(proposals) > 20 and paused
    for tokens, guesses in proposals:
        assert guesses == ref.guesses(tokens, len(guesses)), len(tokens)


def test_an_eagle_head_the_target_cannot_use_is_named(tiny_model, tmp_path) -> None:
    head = make_tiny_eagle_head(tmp_path / "eagle")
    wide = make_tiny_model("llama", tmp_path / "wide", hidden_size=128)
    with pytest.raises(ValueError, match="the EAGLE head's hidden_size \\(64\\) differs from"):
        EngineConfig.from_engine_args(model=str(wide), speculative_config=eagle(head))
    with pytest.raises(ValueError, match="runs with Llama-family targets so far, not OPT"):
        EngineConfig.from_engine_args(model=tiny_model("opt"), speculative_config=eagle(head))
