"""The decode side's hand-off at the front end: what the API process does for a request whose
kv_transfer_params name a prefill instance's KV (docs/proxy.md, kv_connector/first_token.py).

- One request reads a hand-off (`claim`): a second naming it is its client's error.
- A request refused before the engine saw it releases the KV it names (`release_if_rejected`),
  unless another request here reads that hand-off.
- The shipped first token goes to the client at once, not after the load (`ship_first_token`).
- With n > 1 the first sequence reads the hand-off; the others (`followers`) wait here until
  the engine answers for it, then find its KV in the prefix cache.
- A decode instance that recomputed a failed load says so (`path_headers`), as the proxy does
  for its own fallbacks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

from pdserve.engine.core_client import AsyncEngineCoreClient
from pdserve.engine.messages import EngineCoreRequest
from pdserve.kv_connector.first_token import shipped_logprobs
from pdserve.kv_transfer_params import KV_LOAD_FAILED, KVTransferParams
from pdserve.outputs import EngineCoreOutput, RequestOutput
from pdserve.protocol.errors import OpenAIError
from pdserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def remote_read(params: KVTransferParams | None) -> tuple[str, str] | None:
    """(prefill engine, its request id) of the hand-off a decode request reads, if any."""
    if params is None or not params.do_remote_prefill or params.remote_request_id is None:
        return None
    return str(params.remote_engine_id), params.remote_request_id


def path_headers(outputs: Iterable[RequestOutput]) -> dict[str, str]:
    """X-PD-Path of a whole answer whose load failed and was recomputed here (a stream cannot
    say it: its headers go out with the shipped first token)."""
    if any(o.kv_load_recomputed for o in outputs):
        return {"X-PD-Path": f"local; reason={KV_LOAD_FAILED}"}
    return {}


class DecodeHandoff:
    """`process_outputs` hands outputs to the front end's queues; `is_live` says whether an
    engine request id still runs there."""

    def __init__(
        self,
        client: AsyncEngineCoreClient,
        process_outputs: Callable[[list[EngineCoreOutput]], None],
        is_live: Callable[[str], bool],
    ) -> None:
        self.client = client
        self.process_outputs = process_outputs
        self.is_live = is_live
        self.reads: dict[tuple[str, str], str] = {}  # hand-off -> the request reading it
        # Engine id of the sequence that reads a hand-off -> its siblings' requests, not yet
        # sent to the engine.
        self.followers: dict[str, list[EngineCoreRequest]] = {}

    @contextmanager
    def claim(self, request_id: str, params: KVTransferParams | None) -> Iterator[None]:
        """While the request runs, the hand-off it names is its own."""
        remote = remote_read(params)
        if remote is not None:
            holder = self.reads.get(remote)
            if holder is not None:
                raise OpenAIError(
                    400,
                    f"kv_transfer_params.remote_request_id {remote[1]!r} of prefill engine "
                    f"{remote[0]} is already being read by request {holder!r}; a prefill "
                    "hand-off serves one request.",
                    param="kv_transfer_params.remote_request_id",
                )
            self.reads[remote] = request_id
        try:
            yield
        finally:
            if remote is not None:
                del self.reads[remote]

    async def release_if_rejected(self, params: KVTransferParams | None, request_id: str) -> None:
        """The request is refused here: a prefill instance may hold its KV. Not when another
        request here reads that hand-off: freeing it would pull the blocks from under that
        read (the lease frees them if they are this request's)."""
        remote = remote_read(params)
        if remote is not None and remote in self.reads:
            logger.warning(
                "Rejected request %s names the hand-off %s, which request %s reads: not released.",
                request_id,
                remote,
                self.reads[remote],
            )
            return
        if params and params.do_remote_prefill and self.client.dead_reason is None:
            try:
                await self.client.call_utility("release_remote_kv", request_id, params)
            except (TimeoutError, RuntimeError) as e:  # the lease still frees them
                logger.warning(
                    "Could not release the remote KV of rejected request %s: %s", request_id, e
                )

    def send(
        self,
        sequences: list[tuple[str, SamplingParams]],
        params: KVTransferParams | None,
        make: Callable[[str, SamplingParams, KVTransferParams | None], EngineCoreRequest],
    ) -> None:
        """A request's sequences (engine id, params) to the engine as `make` builds them: with
        n > 1 reading a hand-off, the first with the params now, the others without them once
        its load ended."""
        if len(sequences) > 1 and params is not None and params.do_remote_prefill:
            first, *rest = sequences
            self.followers[first[0]] = [make(*sequence, None) for sequence in rest]
            sequences = [first]
        for request in [make(*sequence, params) for sequence in sequences]:
            self.client.add_request(request)
            if request.output_token_ids:
                self.ship_first_token(request)

    def ship_first_token(self, request: EngineCoreRequest) -> None:
        """The token the prefill instance sampled (with its logprobs when asked) goes to the
        client now, not after the load."""
        logprobs = None
        if request.sampling_params.logprobs is not None:
            assert request.kv_transfer_params is not None
            logprobs = shipped_logprobs(
                request.kv_transfer_params, request.sampling_params.logprobs
            )
        self.process_outputs(
            [EngineCoreOutput(request.request_id, request.output_token_ids, logprobs)]
        )
        if not self.is_live(request.request_id):
            # Its text met a stop string: it ends without reading, the others prefill.
            self.release_followers(request.request_id)

    def release_followers(self, request_id: str) -> None:
        for request in self.followers.pop(request_id, ()):
            self.client.add_request(request)

    def on_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        """Whatever a first sequence's news (a token, an error), its load has ended: the others
        find what it loaded in the prefix cache, or prefill the rest."""
        if self.followers:
            for out in outputs:
                self.release_followers(out.request_id)
