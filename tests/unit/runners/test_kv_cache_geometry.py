"""The KV cache's geometry is the model's: read from its attention layers, never from the HF
config by a generic rule. An OPT whose config.json carries num_key_value_heads (HF's OPT
ignores the field; converted configs have it) caches all its heads, serves HF's tokens, and
hands the same layout to the KV connector as the same model without the field."""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import pytest
from transformers import AutoModelForCausalLM

from pdserve.config import EngineConfig
from pdserve.executor.worker import Worker
from pdserve.kv_connector.nixl.metadata import AgentMetadata, HandshakePayload
from pdserve.models.layers.attention import Attention
from pdserve.models.utils import KVCacheGeometry
from tests.unit.engine.test_correctness import (
    assert_pool_full,
    make_llm,
    make_prompts,
    reference,
    run,
)
from tests.utils.tiny_models import make_tiny_model

ARCHS = ["llama", "qwen2", "qwen3", "opt", "qwen2_moe", "mixtral"]
# Fewer than OPT's 4 heads: a cache sized by it cannot hold what the model writes.
OPT_CONFIG_KV_HEADS = 2
NUM_BLOCKS = 8


@pytest.fixture(scope="module")
def opt_with_kv_heads(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("opt_kv_heads") / "model"
    return str(make_tiny_model("opt", path, num_key_value_heads=OPT_CONFIG_KV_HEADS))


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_opt_with_num_key_value_heads_matches_hf(
    opt_with_kv_heads: str, runner: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDSERVE_USE_V2_MODEL_RUNNER", "1" if runner == "v2" else "0")
    with make_llm(opt_with_kv_heads, runner) as llm:
        prompts = make_prompts(llm.config.model_config.vocab_size)
        assert run(llm, prompts) == reference(opt_with_kv_heads, prompts)
        assert_pool_full(llm)


@pytest.mark.parametrize("arch", ARCHS)
def test_model_config_geometry_is_hf_models(tiny_model: Callable[[str], str], arch: str) -> None:
    """The whole model's geometry (what EngineConfig checks TP against) is what HF builds."""
    path = tiny_model(arch)
    hf = AutoModelForCausalLM.from_pretrained(path).model
    layers = hf.decoder.layers if arch == "opt" else hf.layers
    attn = layers[0].self_attn
    expected = KVCacheGeometry(
        len(layers), attn.k_proj.out_features // attn.head_dim, attn.head_dim
    )
    config = EngineConfig.from_engine_args(model=path, dtype="float32")
    assert config.model_config.kv_cache_geometry == expected


def test_tp_checks_count_the_models_kv_heads(opt_with_kv_heads: str) -> None:
    """TP 4 divides OPT's 4 KV heads, whatever its config's num_key_value_heads (2) says."""
    config = EngineConfig.from_engine_args(
        model=opt_with_kv_heads,
        dtype="float32",
        tensor_parallel_size=4,
        distributed_executor_backend="mp",
    )
    assert config.model_config.num_kv_heads == 4


def _worker(path: str, kv_role: str) -> Worker:
    config = EngineConfig.from_engine_args(
        model=path,
        dtype="float32",
        max_model_len=256,
        num_gpu_blocks_override=NUM_BLOCKS,
        kv_transfer_config={"kv_connector": "NixlConnector", "kv_role": kv_role},
    )
    worker = Worker(config)
    worker.load_model()
    return worker


def test_cache_block_bytes_and_handshake_come_from_attention_layers(
    opt_with_kv_heads: str, tiny_model: Callable[[str], str]
) -> None:
    hashes = []
    for path in (opt_with_kv_heads, tiny_model("opt")):
        worker = _worker(path, "kv_producer")
        try:
            runner = worker.model_runner
            assert runner.model is not None
            layers = [m for m in runner.model.modules() if isinstance(m, Attention)]
            heads, head_dim = layers[0].num_kv_heads, layers[0].head_dim
            assert (len(layers), heads, head_dim) == (2, 4, 16)
            assert runner.get_kv_cache_block_bytes() == len(layers) * 2 * 16 * heads * head_dim * 4
            worker.initialize_kv_cache(worker.determine_num_blocks())
            assert runner.kv_cache is not None
            assert runner.kv_cache.shape == (NUM_BLOCKS, len(layers), 2, 16, heads, head_dim)
            encoded = worker.get_kv_connector_handshake_metadata()
            assert encoded is not None
            payload = msgspec.msgpack.decode(encoded, type=HandshakePayload)
            meta = msgspec.msgpack.decode(payload.agent_metadata, type=AgentMetadata)
            assert (meta.num_layers, meta.num_kv_heads, meta.head_dim) == (2, 4, 16)
            assert meta.block_len == runner.get_kv_cache_block_bytes()
            hashes.append(payload.compatibility_hash)
        finally:
            worker.shutdown()
    # The same model with or without the ignored field: one layout, so one compatibility hash.
    assert hashes[0] == hashes[1]
