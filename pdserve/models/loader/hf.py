"""HF folders: config.json, tokenizer.json, generation_config.json and safetensors weights."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

logger = logging.getLogger(__name__)


def load_config(path: Path) -> PretrainedConfig:
    raw = _read_json(path / "config.json")
    if raw.get("model_type") not in CONFIG_MAPPING:
        # transformers does not know it: keep the raw fields, so the registry can name the
        # architecture in its error.
        logger.info(
            "Unknown model_type %r in %s/config.json; reading it raw", raw.get("model_type"), path
        )
        return PretrainedConfig.from_dict(raw)
    try:
        return AutoConfig.from_pretrained(path)
    except Exception as e:  # transformers' validation errors are not all ValueErrors
        raise ValueError(f"Model config {str(path / 'config.json')!r} is invalid: {e}") from e


def load_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(path)


def load_generation_config(path: Path) -> dict[str, Any]:
    """generation_config.json as written (eos_token_id may be an int or a list); else the
    token ids of config.json, as transformers falls back to them."""
    gen_path = path / "generation_config.json"
    if gen_path.is_file():
        return _read_json(gen_path)
    config = _read_json(path / "config.json")
    keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    return {k: config[k] for k in keys if config.get(k) is not None}


def safetensors_files(path: Path) -> list[Path]:
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(_read_json(index)["weight_map"].values()))
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise ValueError(f"Model folder {str(path)!r} lacks the weight shards {missing}.")
        return [path / s for s in shards]
    raise ValueError(
        f"Model folder {str(path)!r} has no weights: expected model.safetensors or "
        "model.safetensors.index.json."
    )


def iterate_weights(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{str(path)!r} is not valid JSON: {e}") from e
