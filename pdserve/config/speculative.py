"""SpeculativeConfig: how the decode steps guess tokens ahead, with vLLM's keys
(`--speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'`).

Every key is checked here and a bad one is named. Which runner runs which method is the
EngineConfig's rule (Model Runner V2: EAGLE, EAGLE-3, MTP); which methods pdserve has built is
`IMPLEMENTED`, and the others are refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdserve.config.model import ModelConfig
from pdserve.validation import check_choice, config_from_dict

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from pdserve.models.loader.source import ModelSource

METHODS = ("ngram", "draft_model", "eagle", "eagle3", "mtp")
# The methods Model Runner V2 runs (vLLM's: EAGLE, EAGLE-3 and MTP; pdserve builds EAGLE so
# far); with another method a model takes V1.
V2_METHODS = ("eagle", "eagle3", "mtp")
IMPLEMENTED = ("ngram", "draft_model", "eagle")
# vLLM's default n-gram window when neither end is given.
_DEFAULT_LOOKUP = 5


@dataclass
class SpeculativeConfig:
    method: str | None = None
    num_speculative_tokens: int | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    # The draft model or EAGLE head; "ngram" / "[ngram]" name the n-gram method (vLLM's rule).
    model: str | None = None

    def __post_init__(self) -> None:
        if self.method is None and self.model in ("ngram", "[ngram]"):
            self.method = "ngram"
        if self.method is None:
            # vLLM infers it from the draft model's architecture; pdserve asks for it.
            raise ValueError(
                "speculative_config.method is required (one of " + ", ".join(METHODS) + ")."
            )
        check_choice("speculative_config.method", self.method, METHODS)
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(
                f"speculative_config.num_speculative_tokens must be a positive integer, got {k!r}."
            )
        if self.method == "ngram":
            self._resolve_lookup()
        else:
            for name in ("prompt_lookup_min", "prompt_lookup_max"):
                if getattr(self, name) is not None:
                    raise ValueError(f"speculative_config.{name} is for method 'ngram' only.")
            if not isinstance(self.model, str) or not self.model:
                raise ValueError(
                    f"speculative_config.model is required for method {self.method!r}: the "
                    "draft model or head to load."
                )

    def _resolve_lookup(self) -> None:
        """vLLM's rule: both unset are 5, one set gives the other its value."""
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None and high is None:
            low = high = _DEFAULT_LOOKUP
        low = high if low is None else low
        high = low if high is None else high
        for name, value in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"speculative_config.{name} must be a positive integer, got {value!r}."
                )
        if low > high:
            raise ValueError(
                f"speculative_config.prompt_lookup_min={low} exceeds prompt_lookup_max={high}."
            )
        self.prompt_lookup_min, self.prompt_lookup_max = low, high

    def check_engine(self, model: Any, sched: Any, parallel: Any) -> None:
        """What speculation runs with so far (ModelConfig, SchedulerConfig, ParallelConfig):
        one pipeline stage, models without recurrent state."""
        if self.method not in IMPLEMENTED:
            raise ValueError(
                f"speculative_config.method={self.method!r}: pdserve runs "
                f"{', '.join(map(repr, IMPLEMENTED))} so far; the EAGLE-3 and MTP drafters are "
                "not built yet."
            )
        if parallel.pipeline_parallel_size > 1:
            raise ValueError(
                "speculative_config with pipeline_parallel_size > 1 is not supported yet: the "
                "drafts are verified on the last stage alone."
            )
        if model.has_inner_state:
            raise ValueError(
                f"speculative_config with {model.architecture}: its recurrent state cannot take "
                "rejected drafts back (vLLM keeps a state per draft position); not supported "
                "yet."
            )
        if self.method == "draft_model":
            self.draft_model_config = self._draft_model_config(model)
        elif self.method == "eagle":
            self.eagle_source, self.eagle_config = self._eagle_config(model)

    def _draft_model_config(self, target: ModelConfig) -> ModelConfig:
        """The draft model, in the target's dtype and length. Its KV layers follow the
        target's in each block (runners/draft_model.py), so they must have the same shape."""
        draft = ModelConfig(
            model=self.model, dtype=target.dtype, max_model_len=target.max_model_len
        )
        if draft.vocab_size != target.vocab_size:
            raise ValueError(
                f"speculative_config.model: the draft model's vocabulary ({draft.vocab_size} "
                f"tokens) differs from the target's ({target.vocab_size})."
            )
        if draft.has_inner_state:
            raise ValueError(
                f"speculative_config.model: a draft model with recurrent state "
                f"({draft.architecture}) is not supported."
            )
        mine, theirs = draft.kv_cache_geometry, target.kv_cache_geometry
        if (mine.num_kv_heads, mine.head_dim, mine.latent) != (
            theirs.num_kv_heads,
            theirs.head_dim,
            theirs.latent,
        ):
            raise ValueError(
                "speculative_config.model: the draft model's KV layers "
                f"({mine.num_kv_heads} heads of {mine.head_dim}) differ from the target's "
                f"({theirs.num_kv_heads} heads of {theirs.head_dim}); its layers share the "
                "target's blocks, so pdserve needs the same shape so far."
            )
        return draft

    def _eagle_config(self, target: ModelConfig) -> tuple[ModelSource, PretrainedConfig]:
        """The EAGLE head's folder and config (a Llama config of its layers). It reads the
        target's hidden states and shares its embedding and LM head, and its KV layers follow
        the target's in each block: all must have the target's sizes."""
        # Imported here: the loader pulls in the model zoo.
        from pdserve.models import loader, registry
        from pdserve.models.layers.decoder import head_dim_of
        from pdserve.models.llama import LlamaForCausalLM

        if not issubclass(registry.get_model_class(target.architecture), LlamaForCausalLM):
            raise ValueError(
                f"speculative_config.method='eagle' runs with Llama-family targets so far, "
                f"not {target.architecture}."
            )
        source = loader.resolve_model_source(self.model)
        head = loader.load_hf_config(source)
        theirs = target.kv_cache_geometry
        kv_heads = getattr(head, "num_key_value_heads", None) or head.num_attention_heads
        for name, mine, want in (
            ("hidden_size", head.hidden_size, target.hf_config.hidden_size),
            ("vocab_size", head.vocab_size, target.vocab_size),
            ("num_key_value_heads", kv_heads, theirs.num_kv_heads),
            ("head_dim", head_dim_of(head), theirs.head_dim),
        ):
            if mine != want:
                raise ValueError(
                    f"speculative_config.model: the EAGLE head's {name} ({mine}) differs from "
                    f"the target's ({want})."
                )
        return source, head

    @property
    def drafter_layout(self) -> str:
        """What the KV connector's handshake compares: a draft model's KV crosses the split
        with the target's, in the same blocks."""
        if self.method == "eagle":
            return f"eagle head of {self.eagle_config.num_hidden_layers} layers"
        if self.method != "draft_model":
            return "none"
        draft = self.draft_model_config
        return f"draft_model {draft.architecture} of {draft.kv_cache_geometry.num_layers} layers"

    @classmethod
    def from_any(cls, value: SpeculativeConfig | dict[str, Any]) -> SpeculativeConfig:
        return config_from_dict(cls, "speculative_config", value)
