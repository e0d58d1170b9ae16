"""The default model with its weights in GGUF blocks (`--quantization gguf`) through a split, in
bf16: the proxy's answers are a single instance's with the same setting, token for token, in
pull and push mode; pools full after."""

from __future__ import annotations

import httpx
import pytest

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
PROMPTS = [[1, 504, 3458, 282, 4649, 314], list(range(400, 480))]  # one block, then five


@pytest.mark.parametrize("kv_mode", ["pull", "push"])
def test_gguf_blocks_through_the_split_match_a_single_instance(kv_mode: str) -> None:
    model = str(default_model_path())
    connector = "NixlPushConnector" if kv_mode == "push" else "NixlConnector"
    servers = start_together(
        lambda: RemoteServer(["serve", "--model", model, *BLOCKS], startup_timeout=600),
        lambda: start_instance(model, "kv_producer", extra_args=BLOCKS, connector=connector),
        lambda: start_instance(model, "kv_consumer", extra_args=BLOCKS, connector=connector),
    )
    single, p, d = servers
    try:
        proxy = split_proxy(p, d, *(["--kv-mode", "push"] if kv_mode == "push" else []))
        servers.append(proxy)
        name = single.client().models.list().data[0].id
        for prompt in PROMPTS:
            answers = [
                httpx.post(
                    f"{server.url}/v1/completions",
                    json=greedy_body(name, prompt, 16),
                    timeout=300,
                ).json()["choices"][0]["token_ids"]
                for server in (single, proxy)
            ]
            assert answers[0] == answers[1]
        for server in (single, p, d):
            server.wait_pool_full(timeout=30)
    finally:
        for server in servers:
            assert server.stop() == [], "processes left behind"
