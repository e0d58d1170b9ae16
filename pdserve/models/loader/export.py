"""`pdserve export`: a GGUF model written out as an HF folder, so that engines that load HF folders
(vLLM, HF transformers) run the very weights and tokenizer pdserve runs from the GGUF file.

The folder holds config.json (LlamaForCausalLM with the GGUF's hyperparameters), model.safetensors
(the weights as pdserve's GGUF loader yields them: dequantized, HF names, q/k rows back in HF's
rotary order), tokenizer.json with tokenizer_config.json (special tokens, chat template inline)
and generation_config.json.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import GenerationConfig

from pdserve.models.loader import gguf
from pdserve.models.loader.source import default_model_path, resolve_model_source

logger = logging.getLogger(__name__)

DTYPES = ("bfloat16", "float32")
# Fields of the saved tokenizer_config.json that describe where this process loaded it from,
# not the tokenizer.
_LOAD_ONLY_FIELDS = ("is_local", "local_files_only", "backend")


def export_hf_folder(model: str, output: Path, dtype: str = "bfloat16") -> Path:
    """Write the GGUF `model` ("default": the bundled SmolLM2) as an HF folder at `output`.

    The folder appears complete or not at all: it is written beside `output` and renamed into
    place, so a cache keyed on the folder's existence never sees half an export.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}.")
    path = _gguf_path(model)
    output = Path(output).expanduser()
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise ValueError(f"output {str(output)!r} exists and is not an empty folder.")
    output.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    partial = output.parent / f".{output.name}.partial-{os.getpid()}"
    shutil.rmtree(
        partial, ignore_errors=True
    )  # left by an export killed in a process with this pid
    partial.mkdir()
    try:
        _write_folder(path, partial, dtype)
        # rename(2) replaces an empty folder, so an existing empty `output` is fine too.
        os.replace(partial, output)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    logger.info(
        "Exported %s as %s (%s) in %.1f s", path, output, dtype, time.perf_counter() - start
    )
    return output


def _gguf_path(model: str) -> Path:
    if model == "default":
        return default_model_path()
    source = resolve_model_source(model)
    if source.kind != "gguf":
        raise ValueError(f"model {model!r} is already an HF folder; export reads a .gguf file.")
    return source.path


def _write_folder(path: Path, folder: Path, dtype: str) -> None:
    hf_config = gguf.load_config(path)
    # vLLM and transformers read it for dtype "auto".
    hf_config.dtype = dtype
    hf_config.save_pretrained(folder)
    GenerationConfig(**gguf.load_generation_config(path)).save_pretrained(folder)

    torch_dtype = getattr(torch, dtype)
    weights = {
        name: tensor.to(torch_dtype).contiguous()
        for name, tensor in gguf.iterate_weights(path, hf_config)
    }
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})

    tokenizer = gguf.load_tokenizer(path)
    # The chat template inline in tokenizer_config.json, where readers older than
    # transformers 5 (and tools that parse the file) look for it.
    tokenizer.save_pretrained(folder, save_jinja_files=False)
    config_path = folder / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text(encoding="utf-8"))
    for field in _LOAD_ONLY_FIELDS:
        tokenizer_config.pop(field, None)
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    tokenizer_config["model_max_length"] = hf_config.max_position_embeddings
    config_path.write_text(json.dumps(tokenizer_config, indent=2) + "\n", encoding="utf-8")
