"""`pdserve proxy`: one OpenAI endpoint in front of prefill and decode instances.

Each request goes twice (vLLM's toy_proxy_server, reference §6.1): a copy to a prefill instance
with `max_tokens=1`, no streaming and `kv_transfer_params={"do_remote_decode": true}`; then the
original, carrying the prefill answer's `kv_transfer_params`, to a decode instance, whose answer
(streamed or not) goes back to the client. One X-Request-Id names both hops; it and
Authorization are the only client headers the hops carry (headers.py). Instances are
chosen among those whose /health answered 200 at the last check, by cached prefix and load
(routing.py); each request is a `Split` (split.py).

With `--kv-mode push` (instances running NixlPushConnector) both hops leave at once and the
prefill instance writes the KV into the decode instance's blocks as it computes
(push_leg.py, docs/push.md).

When the prefill leg cannot be used (no prefill instance is up, its hop failed, or it answered
without `kv_transfer_params`), the decode instance prefills the request itself, never untold:
the response says `X-PD-Path: local; reason=...` (`remote` otherwise) and
`pdserve:proxy_requests_total{path, reason}` on the proxy's /metrics counts it. `--strict-pd`
answers 503 with the reason instead.
"""

from __future__ import annotations

import argparse
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.types import ASGIApp, Receive, Scope, Send

from pdserve.protocol.chat import ChatCompletionRequest
from pdserve.protocol.completion import CompletionRequest
from pdserve.protocol.errors import (
    GENERATION_200,
    OpenAIError,
    error_responses,
    validation_error,
)
from pdserve.proxy.headers import forwarded_headers
from pdserve.proxy.instances import upstream_error
from pdserve.proxy.openapi import ProxySchema
from pdserve.proxy.routing import RoutingConfig, add_routing_args, routing_config
from pdserve.proxy.split import Split
from pdserve.proxy.state import ProxyState

router = APIRouter()
_GENERATION_RESPONSES = {**GENERATION_200, **error_responses(400, 401, 404, 502, 503)}
_BODIES: dict[str, type[CompletionRequest | ChatCompletionRequest]] = {
    "completions": CompletionRequest,
    "chat/completions": ChatCompletionRequest,
}


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
    state = ProxyState(
        prefill, decode, timeout_s, strict_pd, routing or RoutingConfig(), model, kv_mode
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.start()
        yield
        await state.close()

    # /openapi.json is served by a route: the request bodies are the decode instances'.
    app = FastAPI(lifespan=lifespan, openapi_url=None)
    app.state.proxy = state
    app.state.schema = ProxySchema(app, state.pools["decode"])
    app.add_middleware(_Arrival)
    app.include_router(router)

    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, e: OpenAIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    return app


def _state(request: Request) -> ProxyState:
    return request.app.state.proxy


async def _split(request: Request, endpoint: str) -> Response:
    """Completions and chat alike: the body checked as the instances check it (their limits
    aside: the proxy reads its fields), its X-Request-Id in flight while it is served."""
    proxy = _state(request)
    headers = forwarded_headers(request.headers)
    try:
        body = json.loads(await request.body())
    except ValueError as e:
        raise OpenAIError(400, f"Malformed JSON body: {e}") from None
    if not isinstance(body, dict):
        raise OpenAIError(400, "The request body must be a JSON object.")
    try:
        req = _BODIES[endpoint].model_validate(body)
    except ValidationError as e:
        raise validation_error(list(e.errors())) from None
    request_id = headers.setdefault("X-Request-Id", uuid.uuid4().hex)
    if request_id in proxy.in_flight:
        raise OpenAIError(
            400,
            f"X-Request-Id {request_id!r} is already in use by a request in flight; each "
            "request needs its own.",
        )
    proxy.in_flight.add(request_id)
    relaying = False
    try:
        arrival = request.scope["pdserve.arrival"]
        response = await Split(proxy, headers, body, req, endpoint, arrival).run()
        relaying = isinstance(response, StreamingResponse)
        return response
    finally:
        if not relaying:  # a stream's relay lets the id go when it ends
            proxy.in_flight.discard(request_id)


@router.post("/v1/completions", responses=_GENERATION_RESPONSES)
async def completions(request: Request) -> Response:
    return await _split(request, "completions")


@router.post("/v1/chat/completions", responses=_GENERATION_RESPONSES)
async def chat_completions(request: Request) -> Response:
    return await _split(request, "chat/completions")


@router.get("/v1/models", responses=error_responses(401, 503))
async def models(request: Request) -> Response:
    headers = forwarded_headers(request.headers)
    instance = _state(request).pools["decode"].pick()
    try:
        resp = await instance.client.get("/v1/models", headers=headers)
    except httpx.HTTPError as e:
        raise upstream_error(instance, e) from None
    return Response(resp.content, status_code=resp.status_code, media_type="application/json")


@router.get(
    "/metrics",
    response_class=PlainTextResponse,
    responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}},
)
async def metrics_page(request: Request) -> PlainTextResponse:
    registry = _state(request).metrics.registry
    return PlainTextResponse(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/openapi.json", include_in_schema=False)
async def openapi(request: Request) -> JSONResponse:
    return JSONResponse(await request.app.state.schema.get())


@router.get("/health", responses={503: {"description": "Nothing can serve."}})
async def health(request: Request) -> JSONResponse:
    body, serving = _state(request).health()
    return JSONResponse(body, status_code=200 if serving else 503)


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
