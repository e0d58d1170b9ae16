"""`pdserve proxy`: one OpenAI endpoint in front of prefill and decode instances.

Each request goes twice (vLLM's toy_proxy_server, reference §6.1): a copy to a prefill instance
with `max_tokens=1`, no streaming and `kv_transfer_params={"do_remote_decode": true}`; then the
original, carrying the prefill answer's `kv_transfer_params`, to a decode instance, whose answer
(streamed or not) goes back to the client. One X-Request-Id names both hops; it and
Authorization are the only client headers the hops carry (proxy/headers.py). Instances are
chosen among those whose /health answered 200 at the last check, by cached prefix and load
(proxy/routing.py).

With `--kv-mode push` (instances running NixlPushConnector) both hops leave at once and the
prefill instance writes the KV into the decode instance's blocks as it computes
(proxy/push_leg.py, docs/push.md).

When the prefill leg cannot be used (no prefill instance is up, its hop failed, or it answered
without `kv_transfer_params`), the decode instance prefills the request itself, never untold:
the response says `X-PD-Path: local; reason=...` (`remote` otherwise) and
`pdserve:proxy_requests_total{path, reason}` on the proxy's /metrics counts it. `--strict-pd`
answers 503 with the reason instead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.types import ASGIApp, Receive, Scope, Send

from pdserve.entrypoints.openai.errors import (
    GENERATION_200,
    OpenAIError,
    error_responses,
    validation_error,
)
from pdserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from pdserve.proxy.decode_leg import DecodeLeg, close_unread, open_decode
from pdserve.proxy.headers import forwarded_headers
from pdserve.proxy.instances import (
    InstancePool,
    check_forever,
    upstream_error,
)
from pdserve.proxy.metrics import ProxyMetrics
from pdserve.proxy.openapi import ProxySchema
from pdserve.proxy.prefill_leg import PrefillLeg, prefill_leg
from pdserve.proxy.prompts import PromptTokens
from pdserve.proxy.push_leg import can_push, push_legs
from pdserve.proxy.routing import (
    Router,
    RoutingConfig,
    add_routing_args,
    discover_all,
    local_policy,
    routing_config,
)
from pdserve.proxy.sse import (
    as_stream,
    error_event,
    first_token_events,
    without_first_token,
)

logger = logging.getLogger(__name__)


class _Arrival:
    """Stamps each request when the server hands it over, before routing and the body's read:
    Server-Timing's `proxy` part starts there."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope["pdserve.arrival"] = time.perf_counter()
        await self.app(scope, receive, send)


def build_proxy_app(
    prefill: list[str],
    decode: list[str],
    timeout_s: float = 600.0,
    strict_pd: bool = False,
    routing: RoutingConfig | None = None,
    model: str | None = None,
    kv_mode: str = "pull",
) -> FastAPI:
    """`model` (the instances' tokenizer, else the one their /server_info names) lets the proxy
    route by the prompt's cached blocks and apply --pd-min-uncached-tokens. `kv_mode` "push":
    both hops at once, for instances that run NixlPushConnector."""
    pools = {
        "prefill": InstancePool("prefill", prefill, timeout_s),
        "decode": InstancePool("decode", decode, timeout_s),
    }
    routing = routing or RoutingConfig()
    routers = {role: Router(pool, routing) for role, pool in pools.items()}
    prompts = PromptTokens(model)
    metrics = ProxyMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        tasks = [asyncio.create_task(check_forever(list(pools.values())))]
        if routing.policy == "cache_aware":
            tasks.append(asyncio.create_task(discover_all(list(routers.values()), prompts)))
        yield
        for task in tasks:
            task.cancel()
        for router in routers.values():
            router.close()
        for pool in pools.values():
            await pool.close()

    # /openapi.json is served below: the request bodies are the decode instances'.
    app = FastAPI(lifespan=lifespan, openapi_url=None)
    app.add_middleware(_Arrival)
    # X-Request-Ids of the requests being served: one names both hops of its request, so a
    # second request in flight under the same id is refused before it reaches an instance.
    in_flight: set[str] = set()
    # Tasks that outlive their request (closing a decode leg nobody reads); kept referenced.
    background: set[asyncio.Task[None]] = set()

    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, e: OpenAIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    async def handle(request: Request, endpoint: str) -> Response:
        arrival = request.scope["pdserve.arrival"]
        headers = forwarded_headers(request.headers)
        try:
            body = json.loads(await request.body())
        except ValueError as e:
            raise OpenAIError(400, f"Malformed JSON body: {e}") from None
        if not isinstance(body, dict):
            raise OpenAIError(400, "The request body must be a JSON object.")
        # Checked as the instances check it (their limits aside): the proxy reads its fields.
        try:
            req = _BODIES[endpoint].model_validate(body)
        except ValidationError as e:
            raise validation_error(list(e.errors())) from None
        request_id = headers.setdefault("X-Request-Id", uuid.uuid4().hex)
        if request_id in in_flight:
            raise OpenAIError(
                400,
                f"X-Request-Id {request_id!r} is already in use by a request in flight; each "
                "request needs its own.",
            )
        in_flight.add(request_id)
        relaying = False
        try:
            response = await split(headers, body, req, endpoint, arrival)
            relaying = isinstance(response, StreamingResponse)
            return response
        finally:
            if not relaying:  # a stream's relay lets the id go when it ends
                in_flight.discard(request_id)

    async def split(
        headers: dict[str, str],
        body: dict[str, Any],
        req: CompletionRequest | ChatCompletionRequest,
        endpoint: str,
        arrival: float,
    ) -> Response:
        """Both hops of one request, each carrying `headers`; a stream's id stays in flight
        until its relay ends."""
        request_id = headers["X-Request-Id"]
        prompt_logprobs = body.get("prompt_logprobs")
        if body.get("stream") and isinstance(prompt_logprobs, int) and prompt_logprobs > 0:
            # vLLM's refusal, which the prefill instance would not give (its hop is not streamed).
            raise OpenAIError(
                400,
                "`prompt_logprobs` are not available when `stream=True`.",
                param="prompt_logprobs",
            )

        tokens = prompts.of(req)
        hashes = routers["prefill"].hashes(tokens, req.cache_salt)
        decode_route = routers["decode"].pick(hashes)
        prefill_start = time.perf_counter()
        why_local = None
        if not strict_pd:
            block_size = routers["decode"].block_size
            why_local = local_policy(
                routing, decode_route, len(tokens), block_size, pools["prefill"]
            )
        if endpoint == "completions" and _is_batch(body.get("prompt")):
            # One hand-off carries one prompt's KV; the decode instance computes a batch.
            leg = PrefillLeg(reason="batch", detail="a batch of prompts")
        elif why_local is not None:
            leg = PrefillLeg(reason="policy", detail=why_local)
        elif kv_mode == "push" and can_push(body):
            leg = await push_legs(routers["prefill"], hashes, body, endpoint, headers, background)
        else:
            leg = await prefill_leg(routers["prefill"], hashes, body, endpoint, headers)
        prefill_s = time.perf_counter() - prefill_start
        streaming = bool(body.get("stream"))
        # Counted once, when split ends: a whole answer's decode instance may say it recomputed.
        served = (leg.path, leg.reason or "none")
        try:
            if leg.reason is not None:
                logger.info(
                    "Request %s served locally (%s): %s", request_id, leg.reason, leg.detail
                )
                if strict_pd:
                    raise OpenAIError(
                        503,
                        f"The prefill leg could not be used ({leg.reason}: {leg.detail}), and "
                        "--strict-pd refuses to let the decode instance prefill.",
                    )
            elif leg.params is not None:
                # Not prompt_logprobs: the decode instance does not compute the prompt.
                body = {k: v for k, v in body.items() if k != "prompt_logprobs"}
                body["kv_transfer_params"] = leg.params.to_json()
            # Tell the client how it was served and, for the demo, how much KV was handed over.
            out_headers = {
                "X-Request-Id": request_id,
                "X-PD-Path": leg.header,
                "X-PD-KV-Blocks": str(
                    len(leg.params.remote_block_ids or []) if leg.params is not None else 0
                ),
                "X-PD-KV-Mode": kv_mode,
            }
            if leg.instance is not None:
                out_headers["X-PD-Prefill-Instance"] = leg.instance.url

            def first_from_prefill_leg() -> str:
                """Server-Timing of a response whose first token is the prefill instance's."""
                proxy_s = time.perf_counter() - arrival - prefill_s
                return metrics.server_timing({"prefill_leg": prefill_s, "proxy": proxy_s})

            if leg.answer is not None:
                out_headers["Server-Timing"] = first_from_prefill_leg()
                if not body.get("stream"):
                    return JSONResponse(leg.answer, headers=out_headers)
                include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
                events = as_stream(leg.answer, endpoint, include_usage)
                return Response(
                    "".join(events), media_type="text/event-stream", headers=out_headers
                )

            out_headers["X-PD-Decode-Instance"] = decode_route.instance.url

            async def decode_leg() -> DecodeLeg:
                return await open_decode(
                    routers["decode"], decode_route.instance, hashes, endpoint, body, headers
                )

            if (
                streaming
                and leg.hop_answer is not None
                and leg.prompt_logprobs is None
                and body.get("n", 1) == 1
                and not body.get("echo")
                # A tool call's first token is not yet text or a call: the decode instance's
                # stream alone knows which deltas it makes.
                and not (body.get("tools") and body.get("tool_choice") != "none")
            ):
                # The prefill instance's token goes to the client now, before the decode leg;
                # the decode instance's stream follows without it.
                first = first_token_events(leg.hop_answer, endpoint, body.get("stream_options"))
                out_headers["Server-Timing"] = first_from_prefill_leg()

                async def relay_after_first() -> AsyncIterator[bytes]:
                    # The decode leg opens while the first token goes out. A client gone by
                    # then must not leave the prefill instance holding the KV until its lease
                    # ends: the leg opens anyway and is closed, which aborts it there and has
                    # the decode instance release the hand-off.
                    opening = asyncio.create_task(decode_leg())
                    decode_start = time.perf_counter()
                    decode = None
                    try:
                        yield first
                        try:
                            decode = await asyncio.shield(opening)
                        except OpenAIError as e:
                            yield error_event(e)
                            return
                        metrics.timing_parts["decode_first_byte"].observe(
                            time.perf_counter() - decode_start
                        )
                        chunks = without_first_token(decode.answer.aiter_raw(), endpoint)
                        async for chunk in decode.passing(chunks):
                            yield chunk
                    finally:
                        in_flight.discard(request_id)
                        if decode is None:
                            closing = asyncio.create_task(close_unread(opening))
                            background.add(closing)
                            closing.add_done_callback(background.discard)

                return StreamingResponse(
                    relay_after_first(), media_type="text/event-stream", headers=out_headers
                )

            decode_start = time.perf_counter()
            decode = await decode_leg()
            answer = decode.answer
            out_headers["X-PD-Decode-Instance"] = decode.instance.url
            chunks = answer.aiter_raw()
            if streaming and leg.prompt_logprobs is not None:
                chunks = leg.prompt_logprobs.fill_stream(chunks)
            try:
                # A stream's first chunk (the first token) before the headers, so that they can say
                # how long it took: the client's first token follows them at once.
                first = await anext(chunks, b"") if streaming else await answer.aread()
            except BaseException as e:  # the client gone too: closing aborts the decode request
                await decode.close()
                if isinstance(e, httpx.HTTPError):
                    raise upstream_error(decode.instance, e) from None
                raise
            first_byte = time.perf_counter()
            decode_s = first_byte - decode_start
            parts = {
                "prefill_leg": prefill_s,
                "decode_first_byte": decode_s,
                "proxy": first_byte - arrival - prefill_s - decode_s,
            }
            out_headers["Server-Timing"] = metrics.server_timing(parts)
            if not streaming:
                await decode.close()
                decode_path = answer.headers.get("X-PD-Path", "")
                if leg.path == "remote" and decode_path.startswith("local; reason="):
                    # The decode instance recomputed the prompt (its KV load failed).
                    out_headers["X-PD-Path"] = decode_path
                    served = ("local", decode_path.removeprefix("local; reason="))
                if leg.prompt_logprobs is not None:
                    whole = json.loads(first)
                    leg.prompt_logprobs.fill_answer(whole)
                    first = json.dumps(whole).encode()
                return Response(first, media_type="application/json", headers=out_headers)

            async def relay() -> AsyncIterator[bytes]:
                try:
                    yield first
                    async for chunk in decode.passing(chunks):
                        yield chunk
                finally:
                    in_flight.discard(request_id)

            return StreamingResponse(relay(), media_type="text/event-stream", headers=out_headers)
        finally:
            metrics.requests_by_path.labels(*served).inc()

    @app.post(
        "/v1/completions", responses={**GENERATION_200, **error_responses(400, 401, 404, 502, 503)}
    )
    async def completions(request: Request) -> Response:
        return await handle(request, "completions")

    @app.post(
        "/v1/chat/completions",
        responses={**GENERATION_200, **error_responses(400, 401, 404, 502, 503)},
    )
    async def chat_completions(request: Request) -> Response:
        return await handle(request, "chat/completions")

    @app.get("/v1/models", responses=error_responses(401, 503))
    async def models(request: Request) -> Response:
        headers = forwarded_headers(request.headers)
        instance = pools["decode"].pick()
        try:
            resp = await instance.client.get("/v1/models", headers=headers)
        except httpx.HTTPError as e:
            raise upstream_error(instance, e) from None
        return Response(resp.content, status_code=resp.status_code, media_type="application/json")

    @app.get(
        "/metrics",
        response_class=PlainTextResponse,
        responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}},
    )
    async def metrics_page() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    schema = ProxySchema(app, pools["decode"])

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi() -> JSONResponse:
        return JSONResponse(await schema.get())

    @app.get("/health", responses={503: {"description": "Nothing can serve."}})
    async def health() -> JSONResponse:
        status = {role: router.status() for role, router in routers.items()}
        up = {role: any(i["healthy"] for i in s) for role, s in status.items()}
        # Without a prefill instance the decode instances still serve, prefilling themselves.
        serving = up["decode"] and (up["prefill"] or not strict_pd)
        return JSONResponse(
            {"status": "ok" if all(up.values()) else "degraded", **status},
            status_code=200 if serving else 503,
        )

    return app


def add_proxy_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill", nargs="+", action="extend", required=True, metavar="HOST:PORT")
    parser.add_argument("--decode", nargs="+", action="extend", required=True, metavar="HOST:PORT")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds an instance may take to answer one hop",
    )
    parser.add_argument(
        "--strict-pd",
        action="store_true",
        help="answer 503 when the prefill leg cannot be used, instead of letting the decode "
        "instance prefill the request itself (X-PD-Path: local)",
    )
    parser.add_argument(
        "--model",
        default=None,
        help="the instances' model (its tokenizer): routing by cached prefix and "
        "--pd-min-uncached-tokens need the prompt's tokens (default: the model the instances "
        "name in /server_info, when this host can read it)",
    )
    parser.add_argument(
        "--kv-mode",
        choices=["pull", "push"],
        default="pull",
        help="pull: the decode hop follows the prefill hop and reads its KV (NixlConnector); "
        "push: both hops at once, the prefill instance writes the KV as it computes "
        "(instances run NixlPushConnector)",
    )
    add_routing_args(parser)


def run_proxy(args: argparse.Namespace) -> int:
    for address in args.prefill + args.decode:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"instance address {address!r} is not HOST:PORT")
    app = build_proxy_app(
        args.prefill,
        args.decode,
        args.timeout,
        args.strict_pd,
        routing_config(args),
        args.model,
        args.kv_mode,
    )
    uvicorn.Server(
        uvicorn.Config(
            app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=5
        )
    ).run()
    return 0


_BODIES: dict[str, type[CompletionRequest | ChatCompletionRequest]] = {
    "completions": CompletionRequest,
    "chat/completions": ChatCompletionRequest,
}


def _is_batch(prompt: Any) -> bool:
    """Several prompts in one completions body (a list of strings or of token-id lists)."""
    return isinstance(prompt, list) and len(prompt) > 1 and not isinstance(prompt[0], int)
