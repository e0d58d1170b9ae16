"""Which HF architectures pdserve runs, and what the engine must know about each.

Model classes are imported on first use, so reading the registry stays cheap.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from pdserve.registry import Registry


@dataclass(frozen=True)
class ModelInfo:
    architecture: str
    is_hybrid: bool = False
    is_attention_free: bool = False
    has_inner_state: bool = False
    # Set for architectures pdserve recognizes but cannot run, with the reason why.
    unsupported_reason: str | None = None


# The HF architectures pdserve runs (several may share a class).
MODELS: Registry[type[nn.Module]] = Registry(
    "model architecture",
    "architectures",
    {
        "LlamaForCausalLM": "pdserve.models.llama:LlamaForCausalLM",
        "MistralForCausalLM": "pdserve.models.llama:LlamaForCausalLM",
        "Qwen2ForCausalLM": "pdserve.models.llama:Qwen2ForCausalLM",
        "Qwen3ForCausalLM": "pdserve.models.llama:Qwen3ForCausalLM",
        "OPTForCausalLM": "pdserve.models.opt:OPTForCausalLM",
        "Gemma2ForCausalLM": "pdserve.models.gemma2:Gemma2ForCausalLM",
        "Qwen2MoeForCausalLM": "pdserve.models.qwen2_moe:Qwen2MoeForCausalLM",
        "MixtralForCausalLM": "pdserve.models.mixtral:MixtralForCausalLM",
        "GraniteMoeForCausalLM": "pdserve.models.granitemoe:GraniteMoeForCausalLM",
        "DeepseekV2ForCausalLM": "pdserve.models.deepseek_v2:DeepseekV2ForCausalLM",
        "DeepseekV3ForCausalLM": "pdserve.models.deepseek_v2:DeepseekV3ForCausalLM",
        "MambaForCausalLM": "pdserve.models.mamba:MambaForCausalLM",
        "Qwen3_5ForCausalLM": "pdserve.models.qwen3_5:Qwen3_5ForCausalLM",
    },
)


def _stateful(architecture: str, what: str | None = None, *, hybrid: bool) -> ModelInfo:
    """A model with recurrent state: hybrid, or attention-free altogether; `what`, where
    pdserve cannot run it yet, says what it is."""
    return ModelInfo(
        architecture,
        is_hybrid=hybrid,
        is_attention_free=not hybrid,
        has_inner_state=True,
        unsupported_reason=None
        if what is None
        else f"{what}; pdserve runs Mamba and Qwen3.5's text model (Qwen3_5ForCausalLM)",
    )


# What the engine must know of the runnable models with state (the others are plain).
_STATE_MODELS = {
    "MambaForCausalLM": _stateful("MambaForCausalLM", hybrid=False),
    "Qwen3_5ForCausalLM": _stateful("Qwen3_5ForCausalLM", hybrid=True),
}


_QWEN3_5_VL = "Qwen3.5's vision-language model needs its vision encoder, which pdserve lacks"
_UNSUPPORTED: dict[str, ModelInfo] = {
    info.architecture: info
    for info in (
        _stateful(
            "Mamba2ForCausalLM", "Mamba-2 is a state-space model without attention", hybrid=False
        ),
        _stateful("JambaForCausalLM", "Jamba mixes Mamba and attention layers", hybrid=True),
        _stateful("Qwen3_5ForConditionalGeneration", _QWEN3_5_VL, hybrid=True),
    )
}


def supported_architectures() -> list[str]:
    return sorted(MODELS.supported_names())


def get_model_info(architectures: list[str]) -> ModelInfo:
    """The first of `architectures` that pdserve recognizes (runnable or not)."""
    for arch in architectures:
        if arch in MODELS:
            return _STATE_MODELS.get(arch, ModelInfo(arch))
        if arch in _UNSUPPORTED:
            return _UNSUPPORTED[arch]
    raise ValueError(
        f"Model architectures {architectures} are not supported; supported architectures: "
        f"{', '.join(supported_architectures())}."
    )


def get_model_class(architecture: str) -> type[nn.Module]:
    info = get_model_info([architecture])
    if info.unsupported_reason is not None:
        raise ValueError(
            f"Architecture {architecture} is recognized, but pdserve cannot run it: "
            f"{info.unsupported_reason}."
        )
    return MODELS.get(architecture)


def num_experts(hf_config: Any) -> int:
    """Routed experts per MoE layer, read as vLLM does; 0 for a dense model."""
    get_text_config = getattr(hf_config, "get_text_config", None)
    text_config = get_text_config() if callable(get_text_config) else hf_config
    for name in ("num_experts", "moe_num_experts", "n_routed_experts", "num_local_experts"):
        value = getattr(text_config, name, None)
        if value is None:
            continue
        if isinstance(value, (list, tuple)):
            value = value[0] if value else 0
        return int(value)
    return 0
