"""The bundled default model (SmolLM2-135M-Instruct GGUF) through LLM and the CLI."""

from __future__ import annotations

import subprocess
import sys

from pdserve import LLM, SamplingParams

QUESTION = "What is the capital of France?"


def test_default_model_knows_paris():
    # The first token is a near tie ("The" 0.16 above "L" in float32 logits): logits rounded to
    # bf16 came out level and argmax took "L'Étoile, ..."; HF's bf16 answers Paris, as pdserve
    # does with the LM head's float32 logits, through LLM here and the CLI below (the split in
    # tests/distributed/test_pd_deployments.py).
    with LLM(max_model_len=512) as llm:
        assert llm.config.model_config.source.kind == "gguf"
        out = llm.chat(
            [{"role": "user", "content": QUESTION}],
            SamplingParams(max_tokens=24, temperature=0),
            use_tqdm=False,
        )
    assert "Paris" in out[0].outputs[0].text
    result = subprocess.run(
        [sys.executable, "-m", "pdserve.entrypoints.cli", "generate", "--prompt", QUESTION],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


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
