"""vLLM's everyday `serve` flags, each doing what vLLM's does, on a real server; and the engine
flags built from the configuration dataclasses (one source for names, defaults and help)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import openai
import pytest

from pdserve.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from pdserve.config.args import add_engine_args, engine_kwargs
from pdserve.config.model import ModelConfig
from tests.utils.server import RemoteServer


def test_every_flag_field_is_a_flag_with_its_default() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args([])
    kwargs = engine_kwargs(args)
    for cls in (ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig, EngineConfig):
        for f in dataclasses.fields(cls):
            if "flag" in f.metadata:
                assert kwargs[f.name] == f.default, f.name
    flags = parser.parse_args(
        ["--scheduling-policy", "priority", "-tp", "2", "--no-enable-prefix-caching",
         "--kv-cache-memory-bytes", "1000000", "--gpu-memory-utilization", "0.5",
         "--async-scheduling", "--kv-events-config", '{"enable_kv_cache_events": true}']
    )  # fmt: skip
    kwargs = engine_kwargs(flags)
    assert kwargs["policy"] == "priority" and kwargs["tensor_parallel_size"] == 2
    assert kwargs["enable_prefix_caching"] is False and kwargs["async_scheduling"] is True
    assert kwargs["kv_cache_memory_bytes"] == 1_000_000
    assert kwargs["gpu_memory_utilization"] == 0.5
    assert kwargs["kv_events_config"] == {"enable_kv_cache_events": True}


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"kv_cache_memory_bytes": 0}, "kv_cache_memory_bytes"),
        ({"generation_config": "/nonexistent"}, "generation_config"),
        ({"max_logprobs": -2}, "max_logprobs"),
    ],
)
def test_bad_values_name_the_field(tiny_model: Callable[[str], str], kwargs, field) -> None:
    with pytest.raises(ValueError, match=field):
        EngineConfig.from_engine_args(model=tiny_model("llama"), **kwargs)


def test_the_flags_do_what_vllms_do(tiny_model: Callable[[str], str], tmp_path: Path) -> None:
    model = tiny_model("llama")
    # A tokenizer elsewhere (--tokenizer), and a generation config with sampling defaults.
    tokenizer_dir = tmp_path / "tokenizer"
    tokenizer_dir.mkdir()
    for path in Path(model).iterdir():
        if path.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(path, tokenizer_dir / path.name)
    gen_dir = tmp_path / "generation"
    gen_dir.mkdir()
    (gen_dir / "generation_config.json").write_text(
        json.dumps({"eos_token_id": 2, "temperature": 0.0})
    )
    args = ["serve", model, "--dtype", "float32", "--tokenizer", str(tokenizer_dir),
            "--generation-config", str(gen_dir), "--max-logprobs", "2",
            "--gpu-memory-utilization", "0.9", "--kv-cache-memory-bytes", str(8 * 2**20),
            "--enable-log-requests", "--uvicorn-log-level", "info"]  # fmt: skip
    with RemoteServer(args) as server:
        client = server.client()
        prompt = [5, 17, 99, 240, 31, 8]
        # temperature unset: the generation config's 0 makes it greedy, so two runs agree.
        first, second = (
            client.completions.create(model=model, prompt=prompt, max_tokens=8, seed=s)
            .choices[0]
            .text
            for s in (1, 2)
        )
        assert first == second
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=model, prompt=prompt, max_tokens=2, logprobs=3)
        assert e.value.body["param"] == "logprobs" and "max_logprobs=2" in e.value.body["message"]
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=2,
                logprobs=True,
                top_logprobs=5,
            )
        assert e.value.body["param"] == "top_logprobs"
        ok = client.completions.create(model=model, prompt=prompt, max_tokens=2, logprobs=2)
        assert ok.choices[0].logprobs.top_logprobs[0]
        # --kv-cache-memory-bytes sized the cache: 8 MiB of blocks of 2 layers x K and V x
        # 16 tokens x 2 KV heads x 16 dims x 4 bytes (float32), and the null block.
        assert server.metric("kv_cache_total_blocks") == 8 * 2**20 // (2 * 2 * 16 * 2 * 16 * 4)
        log = server.read_log()
        assert "Received request" in log and "prompt_token_ids: [5, 17, 99, 240, 31, 8]" in log
        assert '"POST /v1/completions HTTP/1.1" 200' in log  # uvicorn's access log, at info


def test_an_unsupported_vllm_flag_is_named(tiny_model: Callable[[str], str]) -> None:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "pdserve.entrypoints.cli", "serve", tiny_model("llama"),
         "--cpu-offload-gb", "2"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode != 0
    assert "--cpu-offload-gb" in out.stderr
    assert "not support" in out.stderr and "unrecognized" not in out.stderr
