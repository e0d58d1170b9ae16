"""The vLLM features pdserve does not implement: one list, checked when the configuration is
built.

A vLLM user who passes one of these engine arguments (`LLM(...)`, `AsyncLLM.from_engine_args`,
the CLI flag of the same name) gets an error naming the feature, not an unknown argument; left
at a value that keeps the feature off (vLLM's default), the argument is accepted and ignored.
No configuration field exists only to be rejected.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class UnsupportedFeature:
    arg: str  # vLLM's engine-argument name; its flag is the same with dashes
    feature: str  # what the argument turns on, as the error names it
    off: tuple[Any, ...]  # the values that leave it off, vLLM's default first
    kind: type  # of the flag's value: bool (a switch), int, str, or dict (JSON)
    short_flag: str | None = None  # vLLM's short form

    @property
    def flag(self) -> str:
        return "--" + self.arg.replace("_", "-")

    def check(self, value: Any) -> None:
        if value not in self.off:
            raise ValueError(
                f"{self.arg}={value!r} ({self.flag}): pdserve does not implement {self.feature}."
            )


UNSUPPORTED_FEATURES: dict[str, UnsupportedFeature] = {
    f.arg: f
    for f in (
        UnsupportedFeature("enable_lora", "LoRA adapters", (False,), bool),
        UnsupportedFeature(
            "runner", "runners other than 'generate' (pooling, draft)", ("auto", "generate"), str
        ),
        UnsupportedFeature("enable_prompt_embeds", "prompt embeddings as input", (False,), bool),
        UnsupportedFeature("data_parallel_size", "data parallelism", (1,), int, "-dp"),
        UnsupportedFeature("enable_expert_parallel", "expert parallelism", (False,), bool, "-ep"),
        UnsupportedFeature(
            "prefill_context_parallel_size", "prefill context parallelism", (1,), int, "-pcp"
        ),
        UnsupportedFeature(
            "decode_context_parallel_size", "decode context parallelism", (1,), int, "-dcp"
        ),
        UnsupportedFeature("enable_dbo", "dual batch overlap", (False,), bool),
        UnsupportedFeature(
            "enable_return_routed_experts", "routed experts capture", (False,), bool
        ),
        UnsupportedFeature("kv_sharing_fast_prefill", "KV sharing fast prefill", (False,), bool),
        UnsupportedFeature("ec_transfer_config", "EC (encoder cache) transfer", (None,), dict),
    )
}
