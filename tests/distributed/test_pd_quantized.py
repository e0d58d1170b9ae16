"""The default model with its weights in GGUF blocks (`--quantization gguf`) and an fp8 KV cache
(`--kv-cache-dtype fp8`) through a split, in bf16: the proxy's answers are a single instance's
with the same settings, token for token, in pull and push mode; the handover moves the fp8
codes, half the bf16 cache's bytes a token; pools full after."""

from __future__ import annotations

import httpx
import pytest

from pdserve.config import ModelConfig
from pdserve.kernels.cpu import native
from pdserve.models.loader import default_model_path
from tests.utils.pd import greedy_body, split_proxy, start_instance
from tests.utils.server import RemoteServer, start_together

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (native.cpu_has("avx512_vnni") and native.cpu_has("avx512_bf16")),
        reason="a CPU without AVX-512 VNNI and BF16",
    ),
]
BLOCKS = ["--quantization", "gguf", "--dtype", "bfloat16", "--max-model-len", "512"]
SETTINGS = [*BLOCKS, "--kv-cache-dtype", "fp8"]
PROMPTS = [[1, 504, 3458, 282, 4649, 314], list(range(400, 475))]  # one block, then five


@pytest.mark.parametrize("kv_mode", ["pull", "push"])
def test_gguf_blocks_and_fp8_kv_through_the_split_match_a_single_instance(kv_mode: str) -> None:
    model = str(default_model_path())
    connector = "NixlPushConnector" if kv_mode == "push" else "NixlConnector"
    servers = start_together(
        lambda: RemoteServer(["serve", "--model", model, *SETTINGS], startup_timeout=600),
        lambda: start_instance(model, "kv_producer", extra_args=SETTINGS, connector=connector),
        lambda: start_instance(model, "kv_consumer", extra_args=SETTINGS, connector=connector),
    )
    single, p, d = servers
    try:
        proxy = split_proxy(p, d, *(["--kv-mode", "push"] if kv_mode == "push" else []))
        servers.append(proxy)
        name = single.client().models.list().data[0].id
        moved = []
        for prompt in PROMPTS:
            before = d.metric("kv_transfer_bytes_total")
            answers = [
                httpx.post(
                    f"{server.url}/v1/completions",
                    json=greedy_body(name, prompt, 16),
                    timeout=300,
                ).json()["choices"][0]["token_ids"]
                for server in (single, proxy)
            ]
            assert answers[0] == answers[1]
            moved.append(d.metric("kv_transfer_bytes_total") - before)
        # 75 tokens fill 5 blocks of 16: one byte an element, half of bf16's two.
        geometry = ModelConfig().kv_cache_geometry
        assert (
            moved[1] == 5 * 16 * geometry.bytes_per_token(1) == 5 * 8 * geometry.bytes_per_token(2)
        )
        for server in (single, p, d):
            server.wait_pool_full(timeout=30)
    finally:
        for server in servers:
            assert server.stop() == [], "processes left behind"
