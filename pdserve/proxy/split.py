"""One request through the proxy: its prefill leg (or why the decode instance prefills), then
its decode leg, whose answer goes back to the client (docs/proxy.md)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdserve.kv_connector.first_token import shipped_first_token
from pdserve.protocol.chat import ChatCompletionRequest
from pdserve.protocol.completion import CompletionRequest
from pdserve.protocol.errors import OpenAIError
from pdserve.proxy.decode_leg import DecodeLeg, close_unread, open_decode
from pdserve.proxy.instances import upstream_error
from pdserve.proxy.prefill_leg import PrefillLeg, prefill_leg
from pdserve.proxy.push_leg import can_push, push_legs
from pdserve.proxy.routing import local_policy
from pdserve.proxy.sse import as_stream, error_event, first_token_events, without_first_token
from pdserve.proxy.state import ProxyState

logger = logging.getLogger(__name__)


class Split:
    """Both hops of one request, each carrying the client's forwarded `headers`. `body` is what
    the hops send on; `req`, its validated form, is what the proxy reads."""

    def __init__(
        self,
        proxy: ProxyState,
        headers: dict[str, str],
        body: dict[str, Any],
        req: CompletionRequest | ChatCompletionRequest,
        endpoint: str,
        arrival: float,
    ) -> None:
        self.proxy = proxy
        self.headers = headers
        self.body = body
        self.req = req
        self.endpoint = endpoint
        self.arrival = arrival
        self.request_id = headers["X-Request-Id"]
        self.prefill_s = 0.0
        # (path, reason) counted once, when the split ends: a whole answer's decode instance
        # may say it recomputed.
        self.served = ("remote", "none")

    async def run(self) -> Response:
        """The client's response; a stream's id stays in flight until its relay ends."""
        if self.req.stream and self.req.prompt_logprobs:
            # vLLM's refusal, which the prefill instance would not give (its hop is not streamed).
            raise OpenAIError(
                400,
                "`prompt_logprobs` are not available when `stream=True`.",
                param="prompt_logprobs",
            )
        routers = self.proxy.routers
        tokens = self.proxy.prompts.of(self.req)
        self.hashes = routers["prefill"].hashes(tokens, self.req.cache_salt)
        self.decode_route = routers["decode"].pick(self.hashes)
        leg = await self._prefill(len(tokens))
        self.served = (leg.path, leg.reason or "none")
        try:
            self._take(leg)
            out_headers = self._out_headers(leg)
            if leg.answer is not None:
                return self._prefill_answer(leg, out_headers)
            out_headers["X-PD-Decode-Instance"] = self.decode_route.instance.url
            if self._first_token_first(leg):
                return self._stream_after_first(leg, out_headers)
            return await self._decode(leg, out_headers)
        finally:
            self.proxy.metrics.requests_by_path.labels(*self.served).inc()

    async def _prefill(self, num_tokens: int) -> PrefillLeg:
        """The prefill leg, or why there is none: a batch, the local policy, or a push."""
        proxy, start = self.proxy, time.perf_counter()
        why_local = None
        if not proxy.strict_pd:
            block_size = proxy.routers["decode"].block_size
            pool = proxy.pools["prefill"]
            why_local = local_policy(proxy.routing, self.decode_route, num_tokens, block_size, pool)
        router, args = proxy.routers["prefill"], (self.hashes, self.body, self.endpoint)
        if isinstance(self.req, CompletionRequest) and _is_batch(self.req.prompt):
            # One hand-off carries one prompt's KV; the decode instance computes a batch.
            leg = PrefillLeg(reason="batch", detail="a batch of prompts")
        elif why_local is not None:
            leg = PrefillLeg(reason="policy", detail=why_local)
        elif proxy.kv_mode == "push" and can_push(self.body):
            leg = await push_legs(router, *args, self.headers, proxy.keep)
        else:
            leg = await prefill_leg(router, *args, self.headers)
        self.prefill_s = time.perf_counter() - start
        return leg

    def _take(self, leg: PrefillLeg) -> None:
        """A local path is logged (or refused under --strict-pd); a remote one hands the decode
        hop the KV's params."""
        if leg.reason is not None:
            logger.info(
                "Request %s served locally (%s): %s", self.request_id, leg.reason, leg.detail
            )
            if self.proxy.strict_pd:
                raise OpenAIError(
                    503,
                    f"The prefill leg could not be used ({leg.reason}: {leg.detail}), and "
                    "--strict-pd refuses to let the decode instance prefill.",
                )
        elif leg.params is not None:
            # Not prompt_logprobs: the decode instance does not compute the prompt.
            self.body = {k: v for k, v in self.body.items() if k != "prompt_logprobs"}
            self.body["kv_transfer_params"] = leg.params.to_json()

    def _out_headers(self, leg: PrefillLeg) -> dict[str, str]:
        """How the request was served and, for the demo, how much KV was handed over."""
        blocks = len(leg.params.remote_block_ids or []) if leg.params is not None else 0
        out_headers = {
            "X-Request-Id": self.request_id,
            "X-PD-Path": leg.header,
            "X-PD-KV-Blocks": str(blocks),
            "X-PD-KV-Mode": self.proxy.kv_mode,
        }
        if leg.instance is not None:
            out_headers["X-PD-Prefill-Instance"] = leg.instance.url
        return out_headers

    def _first_from_prefill_leg(self) -> str:
        """Server-Timing of a response whose first token is the prefill instance's."""
        proxy_s = time.perf_counter() - self.arrival - self.prefill_s
        return self.proxy.metrics.server_timing({"prefill_leg": self.prefill_s, "proxy": proxy_s})

    def _prefill_answer(self, leg: PrefillLeg, out_headers: dict[str, str]) -> Response:
        """The prefill instance's answer is the whole of it: no decode leg."""
        assert leg.answer is not None
        out_headers["Server-Timing"] = self._first_from_prefill_leg()
        if not self.req.stream:
            return JSONResponse(leg.answer, headers=out_headers)
        include_usage = bool(self.req.stream_options and self.req.stream_options.include_usage)
        events = as_stream(leg.answer, self.endpoint, include_usage)
        return Response("".join(events), media_type="text/event-stream", headers=out_headers)

    def _first_token_first(self, leg: PrefillLeg) -> bool:
        """Whether the prefill instance's token goes to the client before the decode leg: a
        plain stream of a token the decode side continues from (the rule it applies itself).
        A tool call's first token is not yet text or a call: the decode instance's stream alone
        knows which deltas it makes."""
        req = self.req
        shipped = shipped_first_token(
            leg.params, n=req.n, max_tokens=req.asked_max_tokens(), logprobs=req.asked_logprobs()
        )
        return (
            req.stream
            and leg.hop_answer is not None
            and leg.prompt_logprobs is None
            and shipped is not None
            and not (isinstance(req, CompletionRequest) and req.echo)
            and not (
                isinstance(req, ChatCompletionRequest) and req.tools and req.tool_choice != "none"
            )
        )

    async def _open_decode(self) -> DecodeLeg:
        route = self.decode_route
        routers = self.proxy.routers
        return await open_decode(
            routers["decode"], route.instance, self.hashes, self.endpoint, self.body, self.headers
        )

    def _stream_after_first(self, leg: PrefillLeg, out_headers: dict[str, str]) -> Response:
        """The shipped token now; the decode instance's stream follows without it."""
        assert leg.hop_answer is not None
        stream_options = self.body.get("stream_options")
        first = first_token_events(leg.hop_answer, self.endpoint, stream_options)
        out_headers["Server-Timing"] = self._first_from_prefill_leg()
        relay = self._relay_after_first(first)
        return StreamingResponse(relay, media_type="text/event-stream", headers=out_headers)

    async def _relay_after_first(self, first: bytes) -> AsyncIterator[bytes]:
        # The decode leg opens while the first token goes out. A client gone by then must not
        # leave the prefill instance holding the KV until its lease ends: the leg opens anyway
        # and is closed, which aborts it there and has the decode instance release the hand-off.
        opening = asyncio.create_task(self._open_decode())
        decode_start = time.perf_counter()
        decode = None
        try:
            yield first
            try:
                decode = await asyncio.shield(opening)
            except OpenAIError as e:
                yield error_event(e)
                return
            self.proxy.metrics.timing_parts["decode_first_byte"].observe(
                time.perf_counter() - decode_start
            )
            chunks = without_first_token(decode.answer.aiter_raw(), self.endpoint)
            async for chunk in decode.passing(chunks):
                yield chunk
        finally:
            self.proxy.in_flight.discard(self.request_id)
            if decode is None:
                self.proxy.keep(asyncio.create_task(close_unread(opening)))

    async def _decode(self, leg: PrefillLeg, out_headers: dict[str, str]) -> Response:
        """The decode leg's answer: whole, or its first chunk before the headers, so that they
        can say how long it took (the client's first token follows them at once)."""
        decode_start = time.perf_counter()
        decode, chunks, first = await self._decode_first_watching_push(leg, out_headers)
        out_headers["X-PD-Decode-Instance"] = decode.instance.url
        first_byte = time.perf_counter()
        decode_s = first_byte - decode_start
        parts = {
            "prefill_leg": self.prefill_s,
            "decode_first_byte": decode_s,
            "proxy": first_byte - self.arrival - self.prefill_s - decode_s,
        }
        out_headers["Server-Timing"] = self.proxy.metrics.server_timing(parts)
        if not self.req.stream:
            await decode.close()
            return self._whole_answer(leg, decode, first, out_headers)
        relay = self._relay(decode, first, chunks)
        return StreamingResponse(relay, media_type="text/event-stream", headers=out_headers)

    async def _decode_first_watching_push(
        self, leg: PrefillLeg, out_headers: dict[str, str]
    ) -> tuple[DecodeLeg, AsyncIterator[bytes], bytes]:
        """The decode leg's first bytes. In push mode the prefill hop runs beside it, and if it
        fails first the decode request waits for a push that will never come: it is closed (an
        abort there) instead of waiting out its watchdog. The prefill instance's refusal is the
        client's answer, as in pull mode; its failure makes the path local."""
        if leg.push_hop is None:
            return await self._decode_first(leg)
        decoding = asyncio.create_task(self._decode_first(leg))
        await asyncio.wait({decoding, leg.push_hop}, return_when=asyncio.FIRST_COMPLETED)
        failure = leg.push_hop.result() if leg.push_hop.done() else None
        if decoding.done() or failure is None:
            return await decoding
        decoding.cancel()
        await asyncio.gather(decoding, return_exceptions=True)
        if failure.status < 500:
            raise failure
        local = PrefillLeg(leg.instance, reason="prefill-failed", detail=failure.message)
        self.body = {k: v for k, v in self.body.items() if k != "kv_transfer_params"}
        self._take(local)
        self.served = (local.path, "prefill-failed")
        out_headers["X-PD-Path"] = local.header
        out_headers["X-PD-KV-Blocks"] = "0"
        # The closed hop may still be aborting there under the client's id.
        self.headers = {**self.headers, "X-Request-Id": f"{self.request_id}-local"}
        return await self._decode_first(local)

    async def _decode_first(self, leg: PrefillLeg) -> tuple[DecodeLeg, AsyncIterator[bytes], bytes]:
        """The open decode leg, its chunks and the first of them (the whole answer when not
        streamed); a failure or a cancellation before then closes it, aborting the request."""
        decode = await self._open_decode()
        chunks = decode.answer.aiter_raw()
        if self.req.stream and leg.prompt_logprobs is not None:
            chunks = leg.prompt_logprobs.fill_stream(chunks)
        try:
            first = await anext(chunks, b"") if self.req.stream else await decode.answer.aread()
        except BaseException as e:  # the client gone too: closing aborts the decode request
            await decode.close()
            if isinstance(e, httpx.HTTPError):
                raise upstream_error(decode.instance, e) from None
            raise
        return decode, chunks, first

    def _whole_answer(
        self, leg: PrefillLeg, decode: DecodeLeg, answer: bytes, out_headers: dict[str, str]
    ) -> Response:
        decode_path = decode.answer.headers.get("X-PD-Path", "")
        if leg.path == "remote" and decode_path.startswith("local; reason="):
            # The decode instance recomputed the prompt (its KV load failed).
            out_headers["X-PD-Path"] = decode_path
            self.served = ("local", decode_path.removeprefix("local; reason="))
        if leg.prompt_logprobs is not None:
            whole = json.loads(answer)
            leg.prompt_logprobs.fill_answer(whole)
            answer = json.dumps(whole).encode()
        return Response(answer, media_type="application/json", headers=out_headers)

    async def _relay(
        self, decode: DecodeLeg, first: bytes, chunks: AsyncIterator[bytes]
    ) -> AsyncIterator[bytes]:
        try:
            yield first
            async for chunk in decode.passing(chunks):
                yield chunk
        finally:
            self.proxy.in_flight.discard(self.request_id)


def _is_batch(prompt: Any) -> bool:
    """Several prompts in one completions body (a list of strings or of token-id lists)."""
    return isinstance(prompt, list) and len(prompt) > 1 and not isinstance(prompt[0], int)
