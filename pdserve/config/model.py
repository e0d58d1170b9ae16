"""ModelConfig: which model, in which dtype, and what the engine needs to know about it."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from pdserve.config.args import flag
from pdserve.validation import check_choice, check_positive

if TYPE_CHECKING:
    from pdserve.models.state_cache import StateShapes
    from pdserve.models.utils import KVCacheGeometry

logger = logging.getLogger(__name__)
QUANTIZATIONS = ("gguf", "none")
_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


@dataclass
class ModelConfig:
    model: str | None = flag(
        None, "HF folder or .gguf file (default: the bundled SmolLM2-135M-Instruct)"
    )
    dtype: str = flag("auto", "weights and activations", choices=("auto", *_DTYPES))
    max_model_len: int | None = flag(
        None, "context length, prompt and output (default: the model's)"
    )
    seed: int = flag(0, "seed of the engine's random state")
    # Callables (output_token_ids, logits) -> logits applied per request (runner V1 only).
    logits_processors: list[Callable[..., torch.Tensor]] | None = None
    enforce_eager: bool = flag(
        False, "no CUDA graphs (by default runner V2 captures decode and small mixed steps)"
    )
    served_model_name: str | None = flag(
        None, 'the name clients put in "model" (default: --model as given)'
    )
    tokenizer: str | None = flag(
        None, "HF folder (or tokenizer file's folder) of the tokenizer (default: the model's)"
    )
    generation_config: str = flag(
        "auto",
        "'auto': the model's generation config gives EOS ids and the server's default "
        "sampling parameters; 'vllm': neither (EOS from the model config); or a folder to "
        "read it from",
    )
    quantization: str | None = flag(
        None,
        "'gguf': a .gguf file's projections stay in their blocks (Q4_0, Q4_1, Q8_0, Q4_K), read by "
        "a CPU kernel, or on CUDA by a Triton kernel (not Q4_K) (docs/quantization.md); 'none': "
        "dequantized to --dtype at load; unset: 'gguf' for a .gguf file where a kernel runs "
        "(AVX-512 VNNI and BF16, or CUDA with Triton), else 'none'",
        short="-q",
    )
    max_logprobs: int = flag(
        20, "the most logprobs and prompt_logprobs a request may ask for (-1: no limit)"
    )

    def __post_init__(self) -> None:
        # Imported here: the loader pulls in the model zoo, which config users may not need.
        from pdserve.models import loader, registry

        # Unset, a .gguf file is served as stored where its kernel runs (vLLM: a GGUF path
        # implies --quantization gguf); check_placement falls back where it does not.
        self.quantization_implied = self.quantization is None
        if self.quantization is not None:
            check_choice("quantization", self.quantization, QUANTIZATIONS)

        check_choice("dtype", self.dtype, ("auto", *_DTYPES))
        if self.generation_config not in ("auto", "vllm"):
            if not (Path(self.generation_config) / "generation_config.json").is_file():
                raise ValueError(
                    "generation_config must be 'auto', 'vllm' or a folder holding "
                    f"generation_config.json, got {self.generation_config!r}."
                )
        if self.max_logprobs < -1:
            raise ValueError(
                f"max_logprobs must be -1 (no limit) or more, got {self.max_logprobs}."
            )
        self.source = loader.resolve_model_source(self.model)
        self.hf_config = loader.load_hf_config(self.source)
        self.architectures: list[str] = list(getattr(self.hf_config, "architectures", None) or [])
        info = registry.get_model_info(self.architectures)
        if info.unsupported_reason is not None:
            raise ValueError(
                f"Architecture {info.architecture} is recognized, but pdserve cannot run it: "
                f"{info.unsupported_reason}."
            )
        self.architecture = info.architecture
        if self.quantization_implied:
            self.quantization = "gguf" if self.source.kind == "gguf" else "none"
        if self.quantization == "gguf":
            self._check_gguf_blocks()
        self.is_hybrid = info.is_hybrid
        self.is_attention_free = info.is_attention_free
        self.has_inner_state = info.has_inner_state
        self.is_moe = registry.num_experts(self.hf_config) > 0

        derived = getattr(self.hf_config, "max_position_embeddings", None) or 2048
        if self.max_model_len is None:
            self.max_model_len = derived
        check_positive("max_model_len", self.max_model_len)
        if self.max_model_len > derived:
            raise ValueError(
                f"max_model_len={self.max_model_len} is larger than the model's "
                f"max_position_embeddings={derived}."
            )

    def _check_gguf_blocks(self) -> None:
        if self.source.kind != "gguf":
            raise ValueError(
                f"quantization='gguf' keeps a .gguf file's blocks; {str(self.source.path)!r} "
                "is an HF folder."
            )

    def check_placement(self, device: str) -> None:
        """What runs GGUF blocks: on CPU workers the CPU kernel, on CUDA (or with
        PDSERVE_KERNEL_BACKEND=triton) the Triton dequantize-matmul; any number of workers (a TP
        rank's share of a projection that would split blocks is dequantized:
        models/loader/gguf.py)."""
        from pdserve.kernels import backend, quant_linear

        if self.quantization != "gguf":
            return
        if quant_linear.triton_reads_blocks(torch.device(device)):
            if backend.HAS_TRITON:
                return
            missing = f"on {device} needs the Triton dequantize-matmul, and Triton is not installed"
        elif quant_linear.available():
            return
        else:
            missing = (
                "needs the CPU kernel of kernels/quant_linear.py: a C++ compiler and a CPU with "
                "AVX-512 VNNI and BF16, which this machine lacks"
            )
        if self.quantization_implied:
            logger.info("GGUF weights dequantized at load: blocks %s", missing)
            self.quantization = "none"
            return
        raise ValueError(
            f"quantization='gguf' {missing}; --quantization none dequantizes the weights at load."
        )

    def kept_gguf_types(self, device: str | torch.device) -> tuple[int, ...]:
        """The GGUF formats whose projections stay in their blocks on `device`: the CPU
        kernel's, or the Triton kernel's, which lacks Q4_K (kernels/quant_linear.py)."""
        from pdserve.kernels import quant_linear

        if self.quantization != "gguf":
            return ()
        return quant_linear.kept_qtypes(torch.device(device))

    @property
    def runner_type(self) -> str:
        """The one runner pdserve has; vLLM's `runner` engine argument picks no other."""
        return "generate"

    @property
    def name(self) -> str:
        return self.served_model_name or self.model or self.source.path.stem

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype != "auto":
            return _DTYPES[self.dtype]
        # bf16 on CPU only where the CPU computes it natively (AVX512-BF16 / AMX).
        if torch.cuda.is_available() or _cpu_has_bf16():
            return torch.bfloat16
        return torch.float32

    @cached_property
    def generation_config_dict(self) -> dict[str, Any]:
        """The generation config as written, from where `generation_config` says ({} for
        'vllm')."""
        from pdserve.models import loader

        if self.generation_config == "vllm":
            return {}
        if self.generation_config == "auto":
            return loader.load_generation_config(self.source)
        return json.loads((Path(self.generation_config) / "generation_config.json").read_text())

    @property
    def default_sampling_params(self) -> dict[str, Any]:
        """What the generation config sets of the sampling parameters vLLM's server takes from
        it: a request's unset fields default to these."""
        config = self.generation_config_dict
        keys = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
        return {k: config[k] for k in keys if config.get(k) is not None}

    def load_tokenizer(self) -> PreTrainedTokenizerBase:
        from pdserve.models import loader

        if self.tokenizer is not None:
            return AutoTokenizer.from_pretrained(self.tokenizer)
        return loader.load_tokenizer(self.source)

    @cached_property
    def eos_token_ids(self) -> list[int]:
        """EOS ids from the generation config (or the model config); the first is the primary
        one."""
        eos = self.generation_config_dict.get("eos_token_id")
        if eos is None:
            eos = getattr(self.hf_config, "eos_token_id", None)
        if eos is None:
            return []
        return [eos] if isinstance(eos, int) else list(eos)

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size

    @property
    def num_layers(self) -> int:
        return self.hf_config.num_hidden_layers

    @cached_property
    def kv_cache_geometry(self) -> KVCacheGeometry:
        """The whole model's (every layer, every KV head), read from its attention layers built
        on the meta device (no memory, no weights), before any worker splits it.

        Workers size their caches from the model they built (its stage, its TP rank's heads),
        so the engine and the workers read one source."""
        from pdserve.models.utils import kv_cache_geometry

        return kv_cache_geometry(self._meta_model())

    @cached_property
    def prompt_chunk_alignment(self) -> int:
        """Where a step of a prompt may end short of the prompt's end: on multiples of this
        many tokens (Qwen3.5's DeltaNet chunks; 1: anywhere)."""
        from pdserve.models import registry

        model_class = registry.get_model_class(self.architecture)
        return getattr(model_class, "prompt_chunk_alignment", 1)

    @cached_property
    def state_shapes(self) -> StateShapes:
        """A state model's per layer shapes of one request's state (models/state_cache.py);
        none for a model without one."""
        return self._meta_model().state_shapes() if self.has_inner_state else []

    @property
    def state_layout(self) -> str:
        """The state as the KV connector's handshake compares it; "" for none."""
        from pdserve.models.state_cache import describe

        return describe(self.state_shapes, self.torch_dtype)

    def _meta_model(self) -> torch.nn.Module:
        """The whole model built on the meta device: no memory, no weights."""
        from pdserve.distributed import parallel_state
        from pdserve.models import registry

        # Inside a TP group or a pipeline the layers built would be one rank's share.
        assert parallel_state.get_tensor_model_parallel_world_size() == 1
        assert parallel_state.get_pp_world_size() == 1
        with torch.device("meta"):
            return registry.get_model_class(self.architecture)(self.hf_config, torch.float32)

    @property
    def num_kv_heads(self) -> int:
        return self.kv_cache_geometry.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.kv_cache_geometry.head_dim


def _cpu_has_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags
