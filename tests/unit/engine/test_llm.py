"""The offline LLM: bad input, stop handling, n > 1, logprobs, the default model."""

from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams
from tests.utils.procs import pid_alive


@pytest.fixture(scope="module")
def llm(tiny_model):
    with LLM(model=tiny_model("llama"), dtype="float32", max_model_len=128) as llm:
        yield llm


def pool_is_full(llm: LLM) -> bool:
    core = llm.engine_core
    return core.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == core.num_blocks - 1


def test_unknown_architecture(tmp_path):
    (tmp_path / "config.json").write_text(
        '{"architectures": ["NoSuchForCausalLM"], "model_type": "nosuch"}'
    )
    with pytest.raises(ValueError, match="NoSuchForCausalLM"):
        LLM(model=str(tmp_path))


def test_missing_model_path(tmp_path):
    with pytest.raises(ValueError, match="does-not-exist"):
        LLM(model=str(tmp_path / "does-not-exist"))


def test_prompt_longer_than_max_model_len(llm):
    with pytest.raises(ValueError, match="max_model_len=128"):
        llm.generate({"prompt_token_ids": [5] * 200}, use_tqdm=False)
    assert not llm.engine_core.has_unfinished_requests()
    assert pool_is_full(llm)


def test_out_of_vocab_prompt(llm):
    with pytest.raises(ValueError, match="Prompt token ids"):
        llm.generate({"prompt_token_ids": [5, 10**6]}, use_tqdm=False)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"temperature": -1.0}, "temperature"),
    ],
)
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_max_tokens_and_text(llm):
    out = llm.generate(
        "The capital of France is",
        SamplingParams(max_tokens=7, temperature=0, ignore_eos=True),
        use_tqdm=False,
    )[0]
    seq = out.outputs[0]
    assert len(seq.token_ids) == 7 and seq.finish_reason == "length"
    assert seq.text == llm.get_tokenizer().decode(seq.token_ids, skip_special_tokens=True)
    assert pool_is_full(llm)


def test_stop_string_truncates_and_frees(llm):
    greedy = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    full = llm.generate("Hello", greedy, use_tqdm=False)[0].outputs[0].text
    assert len(full) > 6
    stop = full[3:6]
    out = llm.generate(
        "Hello",
        SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop=[stop]),
        use_tqdm=False,
    )[0]
    seq = out.outputs[0]
    assert seq.finish_reason == "stop" and seq.stop_reason == stop
    assert seq.text == full[: full.index(stop)]
    assert pool_is_full(llm)


def test_stop_token_ids(llm):
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    tokens = llm.generate("Hello", greedy, use_tqdm=False)[0].outputs[0].token_ids
    params = SamplingParams(
        max_tokens=10, temperature=0, ignore_eos=True, stop_token_ids=[tokens[4]]
    )
    seq = llm.generate("Hello", params, use_tqdm=False)[0].outputs[0]
    first = tokens.index(tokens[4])
    assert seq.token_ids == tokens[: first + 1]
    assert seq.finish_reason == "stop" and seq.stop_reason == tokens[4]


def test_n_and_seed(llm):
    params = SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=7)
    out = llm.generate("Hello", params, use_tqdm=False)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    again = llm.generate("Hello", params, use_tqdm=False)[0]
    assert [o.token_ids for o in out.outputs] == [o.token_ids for o in again.outputs]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    assert pool_is_full(llm)


def test_logprobs(llm):
    out = llm.generate(
        "Hello", SamplingParams(max_tokens=4, temperature=0, logprobs=3), use_tqdm=False
    )[0]
    seq = out.outputs[0]
    assert len(seq.logprobs) == len(seq.token_ids)
    for token, entry in zip(seq.token_ids, seq.logprobs):
        assert token in entry and 3 <= len(entry) <= 4
        assert entry[token].rank == 1  # greedy picks the most likely token
    assert seq.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for t, e in zip(seq.token_ids, seq.logprobs))
    )


def test_cache_salt_keeps_prefix_cache_hits_within_a_salt(llm):
    """vLLM's prompt dicts: a TextPrompt or TokensPrompt with a cache_salt hits only blocks
    cached under the same salt (40 tokens: two full blocks of 16)."""
    token_ids = [(i * 7) % 200 + 300 for i in range(40)]
    text = llm.get_tokenizer().decode(token_ids)
    token_ids = llm.get_tokenizer().encode(text)
    greedy = SamplingParams(max_tokens=2, temperature=0)
    prompts = [
        {"prompt": text, "cache_salt": "tenant-a"},
        {"prompt_token_ids": token_ids, "cache_salt": "tenant-b"},
        {"prompt_token_ids": token_ids},
        {"prompt_token_ids": token_ids, "cache_salt": "tenant-a"},
    ]
    outs = [llm.generate(p, greedy, use_tqdm=False)[0] for p in prompts]
    full_blocks = (len(token_ids) - 1) // 16 * 16
    assert [o.num_cached_tokens for o in outs] == [0, 0, 0, full_blocks] and full_blocks == 32
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    for salt in ("", 7):
        with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
            llm.generate({"prompt": text, "cache_salt": salt}, use_tqdm=False)
    assert pool_is_full(llm)


def test_shutdown_is_idempotent(tiny_model):
    """The first shutdown ends the worker processes; the second finds nothing left to do, and
    the LLM refuses work from then on."""
    llm = LLM(
        model=tiny_model("llama"),
        dtype="float32",
        max_model_len=64,
        distributed_executor_backend="mp",
    )
    pids = [w.proc.pid for w in llm.engine_core.executor.workers]
    assert pids and all(pid_alive(p) for p in pids)
    llm.shutdown()
    assert llm.engine_core is None and not any(pid_alive(p) for p in pids)
    llm.shutdown()
    with pytest.raises(AssertionError, match="LLM is shut down"):
        llm.generate("Hello", use_tqdm=False)
