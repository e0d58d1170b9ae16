"""The bundled default model (SmolLM2-135M-Instruct GGUF) through LLM and the CLI."""

from __future__ import annotations

import subprocess
import sys

from pdserve import LLM, SamplingParams


def test_default_model_knows_paris():
    with LLM(max_model_len=512) as llm:
        assert llm.config.model_config.source.kind == "gguf"
        out = llm.chat(
            [{"role": "user", "content": "What is the capital of France?"}],
            SamplingParams(max_tokens=24, temperature=0),
            use_tqdm=False,
        )
    assert "Paris" in out[0].outputs[0].text


def test_cli_generate(tiny_model):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdserve.entrypoints.cli",
            "generate",
            "--model",
            tiny_model("llama"),
            "--dtype",
            "float32",
            "--max-model-len",
            "128",
            "--max-tokens",
            "5",
            "--prompt",
            "Hello",
            "--no-chat",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "Prompt: 'Hello'" in result.stdout and "tok/s" in result.stdout


def test_cli_reports_config_errors(tiny_model):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdserve.entrypoints.cli",
            "generate",
            "--model",
            tiny_model("llama"),
            "--block-size",
            "17",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "block_size" in result.stderr
