"""The bundled default model (SmolLM2-135M-Instruct GGUF) through LLM and the CLI."""

from __future__ import annotations

import subprocess
import sys

from pdserve import LLM, SamplingParams
from pdserve.kernels import quant_linear

QUESTION = "What is the capital of Germany?"


def test_default_model_served_as_stored():
    # Not France's capital: its first token is a near tie ("The" 0.16 above "L" in float32
    # logits) that the stored Q4_1 model served as stored answers "L'Étoile, ..." (llama.cpp on
    # the same file too), and dequantized to bf16 "Paris" (docs/quantization.md).
    with LLM(max_model_len=512) as llm:
        mc = llm.config.model_config
        assert mc.source.kind == "gguf"
        assert mc.quantization == ("gguf" if quant_linear.available() else "none")
        out = llm.chat(
            [{"role": "user", "content": QUESTION}],
            SamplingParams(max_tokens=24, temperature=0),
            use_tqdm=False,
        )
    assert "Berlin" in out[0].outputs[0].text
    result = subprocess.run(
        [sys.executable, "-m", "pdserve.entrypoints.cli", "generate", "--prompt", QUESTION],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "Berlin" in result.stdout


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
            "--max-num-seqs",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "max_num_seqs" in result.stderr and "Traceback" not in result.stderr
