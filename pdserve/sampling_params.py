"""Per-request sampling knobs, validated once at construction."""

from __future__ import annotations

import json
import sys
from typing import Any

import msgspec

_GREEDY_EPS = 1e-5


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True):
    """vLLM's structured outputs: exactly one constraint, which every generated token obeys.

    `json` a JSON schema (a dict or its JSON text; kept as text), `regex` a regular
    expression, `choice` one of these strings, `grammar` an EBNF grammar (xgrammar's dialect,
    GBNF-like), `json_object` any JSON object. `disable_any_whitespace` makes JSON compact.
    Whether the constraint compiles is checked where requests come in
    (structured_output/grammar.py), so a bad one is refused before it reaches the engine.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):
            self.json = json.dumps(self.json)
        kinds = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if self.json_object:
            kinds.append("json_object")
        if len(kinds) != 1:
            raise ValueError(
                "structured_outputs takes exactly one of json, regex, choice, grammar or "
                f"json_object; got {', '.join(kinds) or 'none'}."
            )
        if self.choice is not None and (not self.choice or any(not c for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a list of non-empty strings.")

    @property
    def kind(self) -> str:
        for kind in ("json", "regex", "choice", "grammar"):
            if getattr(self, kind) is not None:
                return kind
        return "json_object"


class SamplingParams(msgspec.Struct, omit_defaults=True):
    """Sampling parameters with vLLM's names and defaults.

    `top_k` 0 or -1 disables top-k. `logprobs` asks for the log-probabilities of that many
    most likely tokens per generated token (the sampled token's is always included);
    `prompt_logprobs` the same at every prompt position but the first (the prompt token's own,
    its rank and the top k), returned once, with the request's first output. A request that
    asks for them takes no prefix-cache hits: every prompt position is computed.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        # A subnormal is zero to a process that flushes them (the engine's CPU kernels do):
        # the smallest normal float stands in, so every process reads a value above zero.
        if 0.0 < self.top_p < sys.float_info.min:
            self.top_p = sys.float_info.min
        if 0.0 < self.repetition_penalty < sys.float_info.min:
            self.repetition_penalty = sys.float_info.min
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < 0:
            raise ValueError(
                f"top_k must be -1 (disable), 0 (disable) or at least 1, got {self.top_k}."
            )
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be non-negative, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                f"got {self.min_tokens}."
            )
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be non-negative, got {self.logprobs}.")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError(f"prompt_logprobs must be non-negative, got {self.prompt_logprobs}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(
                f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}."
            )
        if self.stop_token_ids is not None and any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative, got {self.stop_token_ids}.")
        if self.stop is not None and any(not s for s in self.stop):
            raise ValueError("stop must not contain empty strings.")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )
