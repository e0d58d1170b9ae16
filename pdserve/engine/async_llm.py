"""AsyncLLM: the asyncio front end of an engine running in its own process.

Each request gets a queue of RequestOutputs; one task reads the engine's outputs, detokenizes
them (OutputProcessor) and fills the queues. A caller that goes away (its task cancelled, its
generator closed) aborts its request, so the engine frees the request's blocks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from pdserve.config import EngineConfig
from pdserve.engine.core_client import AsyncEngineCoreClient, EngineDeadError
from pdserve.engine.handoff import DecodeHandoff
from pdserve.engine.input_processor import (
    ChatMessages,
    InputProcessor,
    PromptType,
    prompt_cache_salt,
)
from pdserve.engine.messages import EngineCoreOutputs
from pdserve.engine.output_processor import OutputProcessor
from pdserve.kv_transfer_params import KVTransferParams
from pdserve.metrics import EngineMetrics
from pdserve.outputs import EngineCoreOutput, RequestOutput, RequestOutputKind
from pdserve.sampling_params import SamplingParams
from pdserve.scheduler.scheduler import SchedulerStats

logger = logging.getLogger(__name__)


class RequestRejectedError(ValueError):
    """The engine refused the request (its message says why)."""


class AsyncLLM:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.tokenizer = config.model_config.load_tokenizer()
        self.input_processor = InputProcessor(config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.metrics = EngineMetrics(config.model_config.name)
        self.queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self.client = AsyncEngineCoreClient(config)
        self.handoff = DecodeHandoff(
            self.client,
            self._process_outputs,
            lambda request_id: request_id in self.output_processor.child_to_parent,
        )

    @classmethod
    def from_engine_args(cls, model: str | None = None, **engine_args: Any) -> AsyncLLM:
        return cls(EngineConfig.from_engine_args(model=model, **engine_args))

    async def start(self) -> None:
        self.client.start(self._on_outputs, self._on_dead)

    @property
    def dead_reason(self) -> str | None:
        return self.client.dead_reason

    @property
    def num_in_flight(self) -> int:
        return len(self.queues)

    def apply_chat_template(
        self, messages: ChatMessages, tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        return self.input_processor.apply_chat_template(messages, tools=tools)

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """Raises ValueError for a prompt the model cannot take (empty, too long, bad ids)."""
        return self.input_processor.tokenize(prompt)

    async def generate(
        self,
        prompt: PromptType,
        params: SamplingParams,
        request_id: str,
        kv_transfer_params: KVTransferParams | None = None,
        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
    ) -> AsyncIterator[RequestOutput]:
        """Yields the request's output after every step that changed it, as `output_kind` says:
        everything so far, only the new part (a stream's), or only the final one."""
        if self.client.dead_reason is not None:
            raise EngineDeadError(self.client.dead_reason)
        text, token_ids = self.tokenize(prompt)
        salt = prompt_cache_salt(prompt)
        if request_id in self.queues:
            raise ValueError(f"Request id {request_id!r} is already in use.")
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        children = self.output_processor.add_request(
            request_id, text, token_ids, params, output_kind
        )
        self.queues[request_id] = queue
        self.metrics.request_started(request_id, len(token_ids))
        finished = False
        first_id = children[0][0]
        try:
            self.handoff.send(
                children,
                kv_transfer_params,
                lambda child_id, child_params, kv: self.input_processor.make_request(
                    child_id, token_ids, child_params, kv, cache_salt=salt
                ),
            )
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    # Its other sequences (n > 1) may still run: the finally aborts them.
                    raise item
                finished = item.finished
                yield item
        finally:
            self.queues.pop(request_id, None)
            self.handoff.followers.pop(first_id, None)
            if not finished:
                self._abort(request_id, "abort")

    def _abort(self, request_id: str, reason: str) -> None:
        # Ids the engine does not know (rejected, already finished) are ignored there.
        self.client.abort_requests(self.output_processor.abort_request(request_id))
        self.metrics.request_ended(request_id, reason)

    async def refresh_stats(self) -> SchedulerStats:
        """Ask the engine for fresh numbers (it reports by itself only when it does something)."""
        scheduler_stats, kv_stats = await self.client.call_utility("get_stats")
        stats = msgspec.convert(scheduler_stats, SchedulerStats)
        self.metrics.record_scheduler_stats(stats)
        if kv_stats:
            self.metrics.record_kv_connector_stats(kv_stats)
        return stats

    async def reset_prefix_cache(self) -> bool:
        return bool(await self.client.call_utility("reset_prefix_cache"))

    def _on_outputs(self, msg: EngineCoreOutputs) -> None:
        if msg.scheduler_stats is not None:
            self.metrics.record_scheduler_stats(msg.scheduler_stats)
        if msg.kv_connector_stats:
            self.metrics.record_kv_connector_stats(msg.kv_connector_stats)
        for engine_id, why in (msg.rejected or {}).items():
            parent = self.output_processor.child_to_parent.get(engine_id)
            if parent is not None:
                self._fail(parent[0], RequestRejectedError(why))
        if not msg.outputs:
            return
        self.handoff.on_outputs(msg.outputs)
        self._process_outputs(msg.outputs)

    def _process_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        updates, to_abort = self.output_processor.process_outputs(outputs)
        self.client.abort_requests(to_abort)
        for update in updates:
            self.metrics.request_updated(update)
            queue = self.queues.get(update.request_id)
            if queue is not None and update.output is not None:
                queue.put_nowait(update.output)

    def _fail(self, request_id: str, error: BaseException) -> None:
        queue = self.queues.get(request_id)
        if queue is not None:
            queue.put_nowait(error)

    def _on_dead(self, reason: str) -> None:
        for request_id in list(self.queues):
            self.metrics.request_ended(request_id, "error")
            self._fail(request_id, EngineDeadError(reason))

    def shutdown(self) -> None:
        self.client.shutdown()
