"""EngineConfig: the one configuration object, validated once at construction.

Runner selection and Model Runner V2 validation follow vLLM (docs/runners.md).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields, is_dataclass
from functools import cached_property
from typing import Any

import torch

from pdserve import envs
from pdserve.config.args import flag
from pdserve.config.cache import CacheConfig
from pdserve.config.kv_events import KVEventsConfig
from pdserve.config.kv_transfer import KVTransferConfig
from pdserve.config.model import ModelConfig
from pdserve.config.plugins import EXECUTORS
from pdserve.config.speculative import V2_METHODS as SPEC_V2_METHODS
from pdserve.config.speculative import SpeculativeConfig
from pdserve.config.unsupported import UNSUPPORTED_FEATURES
from pdserve.validation import check_choice, check_positive

logger = logging.getLogger(__name__)

# MoE architectures that default to Model Runner V2; every other MoE model defaults to V1.
DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES = frozenset(
    {"DeepseekV2ForCausalLM", "Qwen2MoeForCausalLM", "GraniteMoeForCausalLM"}
)


@dataclass
class SchedulerConfig:
    max_num_seqs: int = flag(128, "the most requests running at once")
    max_num_batched_tokens: int | None = flag(
        None, "the most tokens in one step (default: 2048 with chunked prefill)"
    )
    enable_chunked_prefill: bool = flag(True, "split long prompts over steps")
    policy: str = flag(
        "fcfs",
        "the order of waiting requests",
        name="--scheduling-policy",
        choices=("fcfs", "priority"),
    )
    async_scheduling: bool | None = flag(None, "schedule step N+1 while step N runs (default: on)")

    def __post_init__(self) -> None:
        if not isinstance(self.async_scheduling, (bool, type(None))):
            raise ValueError(
                f"async_scheduling must be True, False or None, got {self.async_scheduling!r}."
            )
        check_positive("max_num_seqs", self.max_num_seqs)
        check_positive("max_num_batched_tokens", self.max_num_batched_tokens, allow_none=True)
        check_choice("policy", self.policy, ("fcfs", "priority"))


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = flag(1, "tensor-parallel ranks", short="-tp")
    pipeline_parallel_size: int = flag(1, "pipeline stages", short="-pp")
    distributed_executor_backend: str | None = flag(
        None,
        "how ranks run (default: uni for one rank, else mp)",
        choices=EXECUTORS.supported_names,
    )
    # An extension point, and how benchmarks swap in a model-free worker.
    worker_cls: str = flag(
        "pdserve.executor.worker:Worker", '"module:Class" of the worker each rank runs'
    )

    def __post_init__(self) -> None:
        check_positive("tensor_parallel_size", self.tensor_parallel_size)
        if ":" not in self.worker_cls:
            raise ValueError(f"worker_cls must be 'module:Class', got {self.worker_cls!r}.")
        check_positive("pipeline_parallel_size", self.pipeline_parallel_size)
        if self.distributed_executor_backend is not None:
            EXECUTORS.check(self.distributed_executor_backend)
        else:
            self.distributed_executor_backend = "uni" if self.world_size == 1 else "mp"
        if self.distributed_executor_backend == "uni" and self.world_size > 1:
            raise ValueError(
                "distributed_executor_backend='uni' runs one rank; world size "
                f"{self.world_size} (tensor_parallel_size x pipeline_parallel_size) needs 'mp' or 'ray'."
            )

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass
class EngineConfig:
    model_config: ModelConfig = field(default_factory=ModelConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    kv_transfer_config: KVTransferConfig | dict[str, Any] | None = flag(
        None,
        'KV connector settings as JSON, e.g. \'{"kv_connector": "NixlConnector", "kv_role": '
        '"kv_producer"}\'',
        json=True,
    )
    kv_events_config: KVEventsConfig | dict[str, Any] | None = flag(
        None,
        "KV cache events for cache-aware routers, as JSON (vLLM's keys), e.g. "
        '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
        '"replay_endpoint": "tcp://*:5558"}\' (docs/kv_events.md)',
        json=True,
    )
    speculative_config: SpeculativeConfig | dict[str, Any] | None = flag(
        None, 'Speculative decoding as JSON (vLLM\'s keys), e.g. \'{"method": "ngram", '
        '"num_speculative_tokens": 4}\' (docs/spec_decode.md)', short="-sc", json=True,
    )  # fmt: skip
    device: str = "auto"

    def __post_init__(self) -> None:
        check_choice("device", self.device, ("auto", "cpu", "cuda"))
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.model_config.check_placement(self.device)
        if self.speculative_config is not None:
            self.speculative_config = SpeculativeConfig.from_any(self.speculative_config)
            spec, parts = self.speculative_config, (self.scheduler_config, self.parallel_config)
            spec.check_engine(self.model_config, *parts)
        self._resolve_scheduler_limits()
        self._check_pipeline_stages()
        if self.kv_transfer_config is not None:
            self.kv_transfer_config = KVTransferConfig.from_any(self.kv_transfer_config)
            if self.parallel_config.pipeline_parallel_size > 1:
                raise ValueError(
                    "kv_transfer_config with pipeline_parallel_size > 1 is not supported yet: "
                    "the connector reads whole blocks of every layer from one worker."
                )
        if self.kv_events_config is not None:
            self.kv_events_config = KVEventsConfig.from_any(self.kv_events_config)
        if self.cache_config.kv_cache_dtype != "auto":
            self._check_fp8_cache()
        if self.model_config.has_inner_state:
            self._check_state_model()
        if self.use_v2_model_runner:
            self._validate_v2_model_runner()

    @classmethod
    def from_engine_args(cls, **kwargs: Any) -> EngineConfig:
        """Build from vLLM's flat engine-argument names (`LLM(...)`, the CLI); those of the
        features pdserve does not implement (unsupported.py) are refused unless left off."""
        parts: dict[type, dict[str, Any]] = {
            ModelConfig: {},
            CacheConfig: {},
            SchedulerConfig: {},
            ParallelConfig: {},
        }
        top: dict[str, Any] = {}
        for name, value in kwargs.items():
            if name in UNSUPPORTED_FEATURES:
                UNSUPPORTED_FEATURES[name].check(value)
                continue
            owner = _ENGINE_ARG_OWNERS.get(name)
            if owner is None:
                raise ValueError(
                    f"Unknown engine argument {name!r}; known: {', '.join(sorted(_ENGINE_ARG_OWNERS))}."
                )
            (parts[owner] if owner is not EngineConfig else top)[name] = value
        return cls(
            model_config=ModelConfig(**parts[ModelConfig]),
            cache_config=CacheConfig(**parts[CacheConfig]),
            scheduler_config=SchedulerConfig(**parts[SchedulerConfig]),
            parallel_config=ParallelConfig(**parts[ParallelConfig]),
            **top,
        )

    def _resolve_scheduler_limits(self) -> None:
        sched, max_model_len = self.scheduler_config, self.model_config.max_model_len
        if sched.async_scheduling is None:
            # vLLM's default for generate models (the only runner type pdserve has); every
            # executor returns futures for non-blocking steps.
            sched.async_scheduling = True
        if sched.max_num_batched_tokens is None:
            sched.max_num_batched_tokens = (
                2048 if sched.enable_chunked_prefill else max(2048, max_model_len)
            )
        if not sched.enable_chunked_prefill and sched.max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={sched.max_num_batched_tokens} is smaller than "
                f"max_model_len={max_model_len}: without chunked prefill a whole prompt must "
                "fit in one step. Raise it or enable chunked prefill."
            )
        if sched.max_num_batched_tokens < sched.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens={sched.max_num_batched_tokens} must be at least "
                f"max_num_seqs={sched.max_num_seqs}."
            )

    def _check_fp8_cache(self) -> None:
        """What an fp8 KV cache serves so far: keys and values of attention layers, on CPU and
        on a GPU whose Triton has the format (e4m3: compute capability 8.9 or later)."""
        mc, value = self.model_config, self.cache_config.kv_cache_dtype
        if self.device == "cuda" and torch.cuda.is_available():
            from pdserve.kernels.triton.launch_configs import check_fp8_cache_on_cuda

            dtype = self.cache_config.kv_dtype(mc.torch_dtype)
            check_fp8_cache_on_cuda(dtype, torch.cuda.get_device_capability())
        missing = None
        if mc.has_inner_state:
            missing = f"for {mc.architecture}'s state rows, which share the cache's blocks"
        elif mc.kv_cache_geometry.latent:
            missing = f"for {mc.architecture}'s latent cache (MLA)"
        elif self.cache_config.calculate_kv_scales and self.parallel_config.world_size > 1:
            missing = "with calculate_kv_scales and more than one worker (TP or PP)"
        if missing is not None:
            raise ValueError(
                f"kv_cache_dtype={value!r} is not supported {missing} yet; 'auto' keeps the "
                "model's dtype."
            )

    def _check_state_model(self) -> None:
        """A model with recurrent state (Mamba, Qwen3.5) keeps it in a slot per request, not in
        hashed blocks: no prefix cache (logged once), and what it does not do yet is refused by
        name."""
        arch = self.model_config.architecture
        # One block a request, its state's slot (models/state_cache.py).
        self.cache_config.block_size = self.model_config.max_model_len
        if self.cache_config.enable_prefix_caching:
            logger.info(
                "Prefix caching is off for %s: its layers keep a recurrent state per request, "
                "which cached blocks cannot restore.",
                arch,
            )
            self.cache_config.enable_prefix_caching = False
        align, sched = self.model_config.prompt_chunk_alignment, self.scheduler_config
        if sched.enable_chunked_prefill and sched.max_num_batched_tokens < align:
            raise ValueError(
                f"max_num_batched_tokens={sched.max_num_batched_tokens} is below {align}: "
                f"{arch} computes a prompt in whole chunks of {align} tokens, so a step must "
                "hold one."
            )
        par, hf = self.parallel_config, self.model_config.hf_config
        if par.pipeline_parallel_size > 1:
            raise ValueError(
                f"{arch} keeps a recurrent state per request, which pdserve does not split over "
                "pipeline stages yet: pipeline_parallel_size must be 1."
            )
        # Split over TP ranks by channel (Mamba) or head (Qwen3.5's DeltaNet).
        for name in ("intermediate_size", "linear_num_key_heads", "linear_num_value_heads"):
            count = getattr(hf, name, None)
            if count is not None and count % par.tensor_parallel_size:
                raise ValueError(
                    f"tensor_parallel_size={par.tensor_parallel_size} does not divide the "
                    f"model's {name}={count}."
                )
        # Cached now, while no TP group is set up: the KV connector's handshake compares it.
        _ = self.model_config.state_shapes

    def _check_pipeline_stages(self) -> None:
        pp, num_layers = self.parallel_config.pipeline_parallel_size, self.model_config.num_layers
        if pp > num_layers:
            raise ValueError(
                f"pipeline_parallel_size={pp} is larger than the model's {num_layers} layers: "
                "every stage needs at least one layer."
            )
        tp, hf = self.parallel_config.tensor_parallel_size, self.model_config.hf_config
        if self.model_config.is_attention_free:  # no heads (its state is checked apart)
            return
        heads = {"attention heads": hf.num_attention_heads}
        if not self.model_config.kv_cache_geometry.latent:  # a latent is whole on every rank
            heads["KV heads"] = self.model_config.num_kv_heads
        for what, count in heads.items():
            if count % tp:
                raise ValueError(
                    f"tensor_parallel_size={tp} does not divide the model's {count} {what}."
                )

    # ---- runner selection -------------------------------------------------------------------

    @staticmethod
    def _is_default_v2_model_runner_model(config: Any) -> bool:
        """Whether Model Runner V2 is this model's default (takes any object with model_config)."""
        model_config = getattr(config, "model_config", None)
        if model_config is None:
            return False
        if getattr(model_config, "runner_type", None) != "generate":
            return False
        if getattr(model_config, "is_hybrid", False):
            return False
        if getattr(model_config, "is_attention_free", False):
            return False
        architectures = getattr(model_config, "architectures", None) or []
        whitelisted = any(a in DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES for a in architectures)
        return whitelisted or not model_config.is_moe

    def _v2_kernels_available(self) -> bool:
        if self.device == "cpu":
            return True  # the torch reference of every V2 kernel runs on CPU
        try:
            import triton  # noqa: F401
        except ImportError:
            return False
        return True

    def _get_v2_model_runner_unsupported_features(self) -> list[str]:
        """What V2 lacks of what this engine does; the features of vLLM's list that neither
        runner has (speculative decoding, dual batch overlap, ...) are refused before, as
        engine arguments (unsupported.py)."""
        mc = self.model_config
        features = []
        if getattr(mc, "has_inner_state", False):
            features.append("hybrid/mamba models")
        spec = self.speculative_config
        if isinstance(spec, SpeculativeConfig) and spec.method not in SPEC_V2_METHODS:
            features.append(f"speculative method {spec.method!r}")
        if mc.logits_processors:
            features.append("custom logits processors")
        return features

    @cached_property
    def use_v2_model_runner(self) -> bool:
        explicit = envs.use_v2_model_runner()
        if explicit is not None:
            return explicit
        if not self._is_default_v2_model_runner_model(self):
            return False
        reasons = []
        if not self._v2_kernels_available():
            reasons.append(f"its kernels on device {self.device!r} (Triton is not installed)")
        reasons.extend(self._get_v2_model_runner_unsupported_features())
        if reasons:
            logger.warning(
                "Model Runner V2 does not yet support %s; using the V1 model runner instead.",
                ", ".join(reasons),
            )
            return False
        return True

    def _validate_v2_model_runner(self) -> None:
        if not self._v2_kernels_available():
            raise ValueError("Model Runner V2 requires Triton on device 'cuda'.")
        features = self._get_v2_model_runner_unsupported_features()
        if features:
            raise ValueError("Model Runner V2 does not yet support: " + ", ".join(features))

    def to_json(self) -> dict[str, Any]:
        """Every part's settings as JSON (vLLM's /server_info?config_format=json shape): what
        routers read, such as cache_config.block_size and kv_events_config."""
        out: dict[str, Any] = {"device": self.device}
        for f in fields(self):
            part = getattr(self, f.name)
            if is_dataclass(part):
                out[f.name] = {
                    p.name: getattr(part, p.name)
                    for p in fields(part)
                    if _is_json(getattr(part, p.name))
                }
            elif part is None:
                out[f.name] = None
        # Where the weights and tokenizer are, also when the default model was chosen (None).
        out["model_config"]["model"] = str(self.model_config.source.path)
        out["model_config"]["vocab_size"] = self.model_config.vocab_size
        return out

    @property
    def max_concurrent_batches(self) -> int:
        pp = self.parallel_config.pipeline_parallel_size
        if self.scheduler_config.async_scheduling:
            if self.use_v2_model_runner:
                return pp + 1
            if pp == 1:
                return 2
        return pp


def _is_json(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_is_json(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_json(v) for k, v in value.items())
    return value is None or isinstance(value, (str, int, float, bool))


_ENGINE_ARG_OWNERS: dict[str, type] = {
    **{n: ModelConfig for n in ModelConfig.__dataclass_fields__},
    **{n: CacheConfig for n in CacheConfig.__dataclass_fields__},
    **{n: SchedulerConfig for n in SchedulerConfig.__dataclass_fields__},
    **{n: ParallelConfig for n in ParallelConfig.__dataclass_fields__},
    "kv_transfer_config": EngineConfig,
    "kv_events_config": EngineConfig,
    "speculative_config": EngineConfig,
    "device": EngineConfig,
}
