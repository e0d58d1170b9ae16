"""Runner selection (vLLM's truth table), V2 validation, and config errors that name the field."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from pdserve import envs
from pdserve.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from pdserve.config.speculative import SpeculativeConfig

G = "generate"
# (architecture, runner_type, is_moe, is_quantized, extra, expected) from vLLM's tests/test_config.py
TRUTH_TABLE = [
    ("Qwen3ForCausalLM", G, False, False, {}, True),  # Qwen3-1.7B-Base
    ("Qwen3ForCausalLM", G, False, False, {}, True),  # Qwen3-32B
    ("LlamaForCausalLM", G, False, False, {}, True),
    ("MistralForCausalLM", G, False, False, {}, True),
    ("OPTForCausalLM", G, False, False, {}, True),
    ("Gemma2ForCausalLM", G, False, False, {}, True),
    ("DeepseekV2ForCausalLM", G, True, False, {}, True),  # Lite-Chat
    ("DeepseekV2ForCausalLM", G, True, False, {}, True),  # Chat
    ("Qwen2MoeForCausalLM", G, True, False, {}, True),
    ("Qwen2MoeForCausalLM", G, True, False, {}, True),  # -Chat
    ("GraniteMoeForCausalLM", G, True, False, {}, True),
    ("MixtralForCausalLM", G, True, False, {}, False),
    ("Qwen3ForCausalLM", G, False, True, {}, True),  # FP8: quantization is not consulted
    ("Qwen3_5ForConditionalGeneration", G, False, False, {"is_hybrid": True}, False),
    ("MambaForCausalLM", G, False, False, {"is_attention_free": True}, False),
    ("Qwen3ForCausalLM", "pooling", False, False, {}, False),  # Qwen3-Embedding
]


@pytest.mark.parametrize("arch,runner_type,is_moe,is_quantized,extra,expected", TRUTH_TABLE)
def test_is_default_v2_model_runner_model(arch, runner_type, is_moe, is_quantized, extra, expected):
    mc = SimpleNamespace(
        architectures=[arch],
        runner_type=runner_type,
        is_moe=is_moe,
        is_quantized=is_quantized,
        **extra,
    )
    assert (
        EngineConfig._is_default_v2_model_runner_model(SimpleNamespace(model_config=mc)) is expected
    )


def test_no_model_config_is_not_default_v2():
    assert (
        EngineConfig._is_default_v2_model_runner_model(SimpleNamespace(model_config=None)) is False
    )


@pytest.mark.parametrize("value,expected", [(None, None), ("0", False), ("1", True)])
def test_v2_env_tri_state(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv("PDSERVE_USE_V2_MODEL_RUNNER", raising=False)
    else:
        monkeypatch.setenv("PDSERVE_USE_V2_MODEL_RUNNER", value)
    assert envs.use_v2_model_runner() is expected


def test_v2_env_rejects_other_values(monkeypatch):
    monkeypatch.setenv("PDSERVE_USE_V2_MODEL_RUNNER", "true")
    with pytest.raises(ValueError, match="PDSERVE_USE_V2_MODEL_RUNNER"):
        envs.use_v2_model_runner()


def make_config(model: str, **kwargs) -> EngineConfig:
    return EngineConfig.from_engine_args(model=model, **kwargs)


# vLLM's decision tree with real models: every dense generative model gets V2, an MoE model only
# when its architecture is on the whitelist (DeepseekV2, Qwen2Moe, GraniteMoe). DeepSeek-V3 is
# not on it. Forced V2 runs every one of them (tests/unit/engine/test_correctness.py).
DEFAULT_RUNNER = {
    "llama": True,
    "qwen3": True,
    "opt": True,
    "gemma2": True,
    "qwen2_moe": True,
    "granitemoe": True,
    "deepseek_v2": True,
    "mixtral": False,
    "deepseek_v3": False,
    "mamba": False,  # attention-free: V1 by the rule (tests/unit/engine/test_state_models.py)
}


@pytest.mark.parametrize("arch", list(DEFAULT_RUNNER))
def test_default_selection_dense_and_moe(monkeypatch, tiny_model, arch, caplog):
    monkeypatch.delenv("PDSERVE_USE_V2_MODEL_RUNNER", raising=False)
    assert make_config(tiny_model(arch)).use_v2_model_runner is DEFAULT_RUNNER[arch]
    assert "V1 model runner instead" not in caplog.text  # the rule says V1: no fallback warning


def test_explicit_env_wins(monkeypatch, tiny_model):
    monkeypatch.setenv("PDSERVE_USE_V2_MODEL_RUNNER", "1")
    assert make_config(tiny_model("mixtral")).use_v2_model_runner is True
    monkeypatch.setenv("PDSERVE_USE_V2_MODEL_RUNNER", "0")
    assert make_config(tiny_model("llama")).use_v2_model_runner is False


def build(tiny_path: str, overrides: dict) -> EngineConfig:
    from pdserve.config import ModelConfig

    model_kwargs = {k: overrides.pop(k) for k in ("logits_processors",) if k in overrides}
    return EngineConfig(model_config=ModelConfig(model=tiny_path, **model_kwargs), **overrides)


def test_forced_v2_names_what_it_lacks(monkeypatch, tiny_model):
    monkeypatch.setenv("PDSERVE_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(
        ValueError, match="^Model Runner V2 does not yet support: custom logits processors$"
    ):
        build(tiny_model("llama"), {"logits_processors": [lambda ids, logits: logits]})


def test_validation_lists_every_feature():
    # A stand-in config with every feature V2 lacks at once (no real model has them all).
    mc = SimpleNamespace(has_inner_state=True, logits_processors=[lambda ids, logits: logits])
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=2)
    features = EngineConfig._get_v2_model_runner_unsupported_features(
        SimpleNamespace(model_config=mc, speculative_config=spec)
    )
    assert features == [
        "hybrid/mamba models",
        "speculative method 'ngram'",
        "custom logits processors",
    ]


def test_fallback_to_v1_warns_once(monkeypatch, tiny_model, caplog):
    monkeypatch.delenv("PDSERVE_USE_V2_MODEL_RUNNER", raising=False)
    with caplog.at_level(logging.WARNING, logger="pdserve.config"):
        config = build(tiny_model("llama"), {"logits_processors": [lambda ids, logits: logits]})
        assert config.use_v2_model_runner is False
        assert config.use_v2_model_runner is False
    warnings = [r.getMessage() for r in caplog.records if "Model Runner V2" in r.getMessage()]
    assert warnings == [
        "Model Runner V2 does not yet support custom logits processors; using the V1 model runner instead."
    ]


@pytest.mark.parametrize(
    "async_scheduling,v2,pp,expected",
    [
        (False, True, 1, 1),
        (True, True, 1, 2),
        (True, False, 1, 2),
        (False, False, 1, 1),
        (True, True, 2, 3),
        (True, False, 2, 2),
        (False, True, 2, 2),
    ],
)
def test_max_concurrent_batches(async_scheduling, v2, pp, expected):
    config = SimpleNamespace(
        parallel_config=SimpleNamespace(pipeline_parallel_size=pp),
        scheduler_config=SimpleNamespace(async_scheduling=async_scheduling),
        use_v2_model_runner=v2,
    )
    assert EngineConfig.max_concurrent_batches.fget(config) == expected


@pytest.mark.parametrize("value,expected", [(None, True), (True, True), (False, False)])
def test_async_scheduling_is_on_by_default(monkeypatch, tiny_model, value, expected):
    monkeypatch.setenv("PDSERVE_USE_V2_MODEL_RUNNER", "1")
    config = make_config(tiny_model("llama"), async_scheduling=value)
    assert config.scheduler_config.async_scheduling is expected
    assert config.max_concurrent_batches == (2 if expected else 1)


@pytest.mark.parametrize(
    "make,field",
    [
        (lambda: SchedulerConfig(max_num_seqs=0), "max_num_seqs"),
        (lambda: SchedulerConfig(max_num_batched_tokens=-5), "max_num_batched_tokens"),
        (lambda: SchedulerConfig(policy="lifo"), "policy"),
        (lambda: CacheConfig(block_size=17), "block_size"),
        (lambda: CacheConfig(num_gpu_blocks_override=1), "num_gpu_blocks_override"),
        (lambda: ParallelConfig(tensor_parallel_size=0), "tensor_parallel_size"),
        (
            lambda: ParallelConfig(distributed_executor_backend="mpi"),
            "distributed_executor_backend",
        ),
    ],
)
def test_invalid_values_name_the_field(make, field):
    with pytest.raises(ValueError, match=field):
        make()


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"dtype": "int8"}, "dtype"),
        ({"max_model_len": 10**7}, "max_model_len"),
        (
            {"max_model_len": 512, "enable_chunked_prefill": False, "max_num_batched_tokens": 256},
            "max_num_batched_tokens",
        ),
        ({"pipeline_parallel_size": 3}, "pipeline_parallel_size"),  # the model has 2 layers
        (
            {"tensor_parallel_size": 2, "distributed_executor_backend": "uni"},
            "distributed_executor_backend",
        ),
        (
            {"kv_transfer_config": {"kv_connector": "NoSuchConnector"}},
            "kv_transfer_config.kv_connector",
        ),
        ({"kv_transfer_config": {"kv_role": "kv_reader"}}, "kv_transfer_config.kv_role"),
        (
            {"kv_transfer_config": {"kv_role": "kv_producer", "bogus": 1}},
            "kv_transfer_config has unknown keys",
        ),
        ({"kv_transfer_config": "NixlConnector"}, "kv_transfer_config must be an object"),
        ({"kv_transfer_config": {"kv_connector_extra_config": {"transport": "tcp"}}}, "transport"),
        (
            {"kv_transfer_config": {"kv_connector_extra_config": {"kv_lease_duration": 0}}},
            "kv_lease_duration",
        ),
        (
            {
                "kv_transfer_config": {
                    "kv_connector_extra_config": {"kv_load_failure_policy": "retry"}
                }
            },
            "kv_load_failure_policy",
        ),
        ({"kv_transfer_config": {"kv_connector_extra_config": {"lease": 3}}}, "unknown keys"),
        (
            {
                "kv_transfer_config": {"kv_role": "kv_producer"},
                "pipeline_parallel_size": 2,
                "distributed_executor_backend": "mp",
            },
            "pipeline_parallel_size > 1",
        ),
        ({"async_scheduling": "yes"}, "async_scheduling"),
        ({"no_such_knob": 1}, "no_such_knob"),
    ],
)
def test_engine_args_errors_name_the_field(tiny_model, kwargs, field):
    with pytest.raises(ValueError, match=field):
        make_config(tiny_model("llama"), **kwargs)


def test_tensor_parallel_size_must_divide_the_heads(tiny_model):
    # The tiny llama has 4 attention heads and 2 KV heads.
    with pytest.raises(
        ValueError, match="tensor_parallel_size=3 does not divide the model's 4 attention heads"
    ):
        make_config(tiny_model("llama"), tensor_parallel_size=3, distributed_executor_backend="mp")
    with pytest.raises(
        ValueError, match="tensor_parallel_size=4 does not divide the model's 2 KV heads"
    ):
        make_config(tiny_model("llama"), tensor_parallel_size=4, distributed_executor_backend="mp")


def test_kv_transfer_config_defaults_follow_vllm(tiny_model):
    config = make_config(
        tiny_model("llama"),
        kv_transfer_config={"kv_connector": "NixlConnector", "kv_role": "kv_consumer"},
    )
    kv = config.kv_transfer_config
    assert kv.transport == "nixl" and kv.kv_lease_duration == 30.0
    assert kv.kv_load_failure_policy == "fail" and kv.enforce_handshake_compat
    assert kv.kv_role == "kv_consumer"
    assert kv.engine_id  # a random id unless given
