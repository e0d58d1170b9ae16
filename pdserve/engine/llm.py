"""LLM: offline generation with vLLM's interface, running the engine in-process."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from pdserve.config import EngineConfig
from pdserve.engine.core import EngineCore
from pdserve.engine.input_processor import (
    ChatMessages,
    InputProcessor,
    PromptType,
    prompt_cache_salt,
)
from pdserve.engine.output_processor import OutputProcessor
from pdserve.outputs import RequestOutput, RequestOutputKind
from pdserve.sampling_params import SamplingParams
from pdserve.structured_output import grammar

logger = logging.getLogger(__name__)


class LLM:
    """`LLM(model=None)` serves the default model; keyword arguments use vLLM's engine names."""

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.config = EngineConfig.from_engine_args(model=model, **engine_args)
        self.tokenizer = self.config.model_config.load_tokenizer()
        self.input_processor = InputProcessor(self.config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.engine_core: EngineCore | None = EngineCore(self.config)
        self._request_counter = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(
                f"sampling_params has {len(sampling_params)} entries for {len(prompts)} prompts."
            )
        request_ids = []
        try:
            for prompt, params in zip(prompts, sampling_params):
                request_ids.append(self._add_request(prompt, params))
            return self._run_engine(request_ids, use_tqdm)
        except BaseException:
            self._abort(request_ids)
            raise

    def chat(
        self,
        messages: ChatMessages | Sequence[ChatMessages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            {"prompt_token_ids": self.apply_chat_template(conv, add_generation_prompt)}
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(
        self, messages: ChatMessages, add_generation_prompt: bool = True
    ) -> list[int]:
        return self.input_processor.apply_chat_template(messages, add_generation_prompt)

    def _add_request(self, prompt: PromptType, params: SamplingParams) -> str:
        assert self.engine_core is not None, "LLM is shut down"
        if params.structured_outputs is not None:
            grammar.check(params.structured_outputs)
        text, token_ids = self.input_processor.tokenize(prompt)
        salt = prompt_cache_salt(prompt)
        request_id = str(next(self._request_counter))
        children = self.output_processor.add_request(
            request_id, text, token_ids, params, RequestOutputKind.FINAL_ONLY
        )
        try:
            for child_id, child_params in children:
                self.engine_core.add_request(
                    self.input_processor.make_request(
                        child_id, token_ids, child_params, cache_salt=salt
                    )
                )
        except BaseException:
            self._abort([request_id])
            raise
        return request_id

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        assert self.engine_core is not None
        finished: dict[str, RequestOutput] = {}
        pending = set(request_ids)
        bar = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm)
        try:
            while pending:
                outputs = self.engine_core.step()
                updates, to_abort = self.output_processor.process_outputs(outputs)
                if to_abort:
                    self.engine_core.abort_requests(to_abort)
                for update in updates:
                    if update.output is not None and update.request_id in pending:
                        pending.discard(update.request_id)
                        finished[update.request_id] = update.output
                        bar.update(1)
                if not outputs and not self.engine_core.has_unfinished_requests() and pending:
                    raise RuntimeError(f"Engine stopped with {len(pending)} unfinished requests.")
        finally:
            bar.close()
        return [finished[r] for r in request_ids]

    def _abort(self, request_ids: list[str]) -> None:
        if self.engine_core is None:
            return
        engine_ids = [e for r in request_ids for e in self.output_processor.abort_request(r)]
        self.engine_core.abort_requests(engine_ids)

    def shutdown(self) -> None:
        if self.engine_core is not None:
            self.engine_core.shutdown()
            self.engine_core = None

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
