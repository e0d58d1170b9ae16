"""`pdserve serve`: the FastAPI app around one AsyncLLM, run by uvicorn.

The engine starts before the HTTP port opens, so a server that answers /health is ready.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

import pdserve
from pdserve import envs
from pdserve.engine.async_llm import AsyncLLM, RequestRejectedError
from pdserve.engine.core_client import EngineDeadError
from pdserve.entrypoints.openai.drain import Drain
from pdserve.entrypoints.openai.serving import OpenAIServing, Prompt, RequestFailedError
from pdserve.entrypoints.openai.serving_chat import OpenAIServingChat
from pdserve.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pdserve.entrypoints.openai.tokenization import detokenize, tokenize
from pdserve.kv_transfer_params import KVTransferParams
from pdserve.protocol.chat import ChatCompletionRequest
from pdserve.protocol.common import declare_model_limits
from pdserve.protocol.completion import CompletionRequest
from pdserve.protocol.errors import (
    GENERATION_200,
    OpenAIError,
    error_responses,
    validation_error,
    without_validation_422,
)
from pdserve.protocol.tokenize import DetokenizeRequest, TokenizeRequest
from pdserve.protocol.tool_calls import TOOL_PARSERS
from pdserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


# What a draining instance refuses: new work. Its /metrics, /health and /server_info still answer.
_REFUSED_WHILE_DRAINING = {"/v1/completions", "/v1/chat/completions"}


def error_response(error: OpenAIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


T = TypeVar("T")


async def with_cancellation(request: Request, work: Awaitable[T]) -> T | None:
    """Run a non-streaming handler; if the client goes away first, cancel it (which aborts)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnected(request))
    await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        watcher.cancel()
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return None


def build_app(
    engine: AsyncLLM,
    model_name: str,
    api_key: str | None,
    max_pending_requests: int | None = None,
    drain: Drain | None = None,
    tool_parser: str | None = None,
) -> FastAPI:
    """`tool_parser`: the parser tool_choice "auto" reads calls with (None: "auto" is a 400)."""
    serving = OpenAIServing(engine, model_name, max_pending_requests)
    completion = OpenAIServingCompletion(serving)
    chat = OpenAIServingChat(serving, tool_parser)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        if drain is not None:
            drain.install()
        yield

    app = FastAPI(lifespan=lifespan)

    @app.middleware("http")
    async def authenticate(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        if drain is not None and drain.draining and request.url.path in _REFUSED_WHILE_DRAINING:
            return error_response(
                OpenAIError(
                    503,
                    "This instance is draining (shutting down); send the request elsewhere.",
                    "ServiceUnavailableError",
                )
            )
        if (
            api_key
            and request.url.path != "/health"
            and request.headers.get("Authorization") != f"Bearer {api_key}"
        ):
            return error_response(OpenAIError(401, "Invalid or missing API key."))
        return await call_next(request)

    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, e: OpenAIError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        # A body refused before it is read may still name a prefill instance's KV: free it now
        # rather than at the end of its lease (pd_lessons 2).
        body = e.body if isinstance(e.body, dict) else {}
        try:
            params = KVTransferParams.from_json(body.get("kv_transfer_params"))
        except (ValueError, TypeError, msgspec.ValidationError):
            params = None
        if params is not None:
            await serving.release_if_rejected(params, request_id_of(request))
        return error_response(validation_error(list(e.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        # Starlette's own answers (404 no route, 405 with its Allow header) keep their headers.
        response = error_response(OpenAIError(e.status_code, str(e.detail)))
        response.headers.update(e.headers or {})
        return response

    @app.exception_handler(EngineDeadError)
    async def engine_dead(request: Request, e: EngineDeadError) -> JSONResponse:
        return error_response(OpenAIError(503, f"The engine is not available: {e}"))

    @app.exception_handler(RequestFailedError)
    async def failed(request: Request, e: RequestFailedError) -> JSONResponse:
        return error_response(OpenAIError(500, str(e)))

    @app.exception_handler(RequestRejectedError)
    async def rejected(request: Request, e: RequestRejectedError) -> JSONResponse:
        return error_response(OpenAIError(400, str(e)))

    def request_id_of(request: Request) -> str:
        # The proxy sends one X-Request-Id through both hops of a split request.
        return request.headers.get("X-Request-Id") or uuid.uuid4().hex

    async def respond(
        request: Request,
        stream: bool,
        full: Callable[[], Awaitable[tuple[dict, dict[str, str]]]],
        chunks: Callable[[], AsyncIterator[str]],
    ) -> Response:
        if stream:
            iterator = chunks()
            # The first chunk is produced here, so a bad request is still a 400, not a stream.
            try:
                first = await iterator.__anext__()
            except StopAsyncIteration:
                first = ""
            return StreamingResponse(_prepend(first, iterator), media_type="text/event-stream")
        answer = await with_cancellation(request, full())
        if answer is None:
            return Response(status_code=499)
        body, headers = answer
        return JSONResponse(body, headers=headers)

    async def refusing(
        body: CompletionRequest | ChatCompletionRequest, rid: str, work: Awaitable[Response]
    ) -> Response:
        try:
            return await work
        except OpenAIError as e:
            if e.status < 500:  # refused before the engine saw it: free the prefill side's KV now
                await serving.release_if_rejected(body.kv_transfer_params, rid)
            raise

    @app.post(
        "/v1/completions", responses={**GENERATION_200, **error_responses(400, 401, 404, 503)}
    )
    async def completions(body: CompletionRequest, request: Request) -> Response:
        rid = request_id_of(request)
        return await refusing(
            body,
            rid,
            respond(
                request,
                body.stream,
                lambda: completion.completion(body, rid),
                lambda: completion.completion_stream(body, rid),
            ),
        )

    @app.post(
        "/v1/chat/completions", responses={**GENERATION_200, **error_responses(400, 401, 404, 503)}
    )
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        rid = request_id_of(request)
        return await refusing(
            body,
            rid,
            respond(
                request,
                body.stream,
                lambda: chat.chat(body, rid),
                lambda: chat.chat_stream(body, rid),
            ),
        )

    @app.post("/v1/completions/render", responses=error_responses(400, 401, 404))
    async def completions_render(body: CompletionRequest, request: Request) -> list[dict]:
        """What each prompt would run as, without running it (vLLM's render endpoint):
        routers tokenize through it to score prefixes."""
        return render(request_id_of(request), completion.prepare_completion(body), body.stream)

    @app.post("/v1/chat/completions/render", responses=error_responses(400, 401, 404))
    async def chat_completions_render(body: ChatCompletionRequest, request: Request) -> dict:
        return render(request_id_of(request), chat.prepare_chat(body), body.stream)[0]

    def render(
        request_id: str, prepared: list[tuple[Prompt, SamplingParams]], stream: bool
    ) -> list[dict[str, Any]]:
        return [
            {
                "request_id": request_id if len(prepared) == 1 else f"{request_id}-{i}",
                "token_ids": prompt["prompt_token_ids"],
                "model": model_name,
                "sampling_params": msgspec.to_builtins(params),
                "stream": stream,
            }
            for i, (prompt, params) in enumerate(prepared)
        ]

    @app.post("/tokenize", responses=error_responses(400, 401, 404))
    async def tokenize_endpoint(body: TokenizeRequest) -> dict[str, Any]:
        serving.check_model(body.model)
        return tokenize(engine, body)

    @app.post("/detokenize", responses=error_responses(400, 401, 404))
    async def detokenize_endpoint(body: DetokenizeRequest) -> dict[str, Any]:
        serving.check_model(body.model)
        return detokenize(engine, body)

    @app.get("/v1/models", responses=error_responses(401))
    async def models() -> dict[str, Any]:
        card = {
            "id": model_name,
            "object": "model",
            "owned_by": "pdserve",
            "max_model_len": serving.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.get(
        "/health",
        response_class=Response,
        responses={
            200: {"description": "Serving (an empty body)."},
            503: {
                "description": "Draining, or the engine is dead (the reason).",
                "content": {"application/json": {}},
            },
        },
    )
    async def health() -> Response:
        if engine.dead_reason is not None:
            return error_response(OpenAIError(503, engine.dead_reason))
        if drain is not None and drain.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return Response(status_code=200)

    @app.get("/server_info", responses=error_responses(401))
    async def server_info(config_format: str = "text") -> dict[str, Any]:
        """The engine's configuration (vLLM's endpoint): routers read the block size and the
        KV events' endpoints from it; a push-mode proxy reads where the KV side channel is."""
        config = engine.config.to_json()
        info: dict[str, Any] = {
            "vllm_config": config if config_format == "json" else json.dumps(config)
        }
        if engine.config.kv_transfer_config is not None:
            info["kv_side_channel"] = {
                "host": envs.side_channel_host(),
                "port": envs.side_channel_port(),
            }
        return info

    @app.get("/version", responses=error_responses(401))
    async def version() -> dict[str, str]:
        return {"version": pdserve.__version__}

    @app.get(
        "/metrics",
        response_class=PlainTextResponse,
        responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}, **error_responses(401)},
    )
    async def metrics() -> Response:
        if engine.dead_reason is None:
            # Fresh numbers: the engine only reports by itself when it does something.
            try:
                await engine.refresh_stats()
            except (TimeoutError, EngineDeadError):
                pass
        return Response(generate_latest(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    openapi = app.openapi
    mc = engine.config.model_config
    limits = {
        "vocab": mc.vocab_size - 1,
        "max_logprobs": None if mc.max_logprobs < 0 else mc.max_logprobs,
        "max_num_seqs": engine.config.scheduler_config.max_num_seqs,
    }
    app.openapi = lambda: declare_model_limits(without_validation_422(openapi()), limits)  # type: ignore[method-assign]
    return app


async def _prepend(first: str, rest: AsyncIterator[str]) -> AsyncIterator[str]:
    if first:
        yield first
    async for chunk in rest:
        yield chunk


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--api-key", default=None, help="require this bearer token (or PDSERVE_API_KEY)"
    )
    parser.add_argument(
        "--max-pending-requests",
        type=int,
        default=None,
        help="answer 503 beyond this many requests in flight (default: no limit)",
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=120.0,
        help="on SIGTERM, seconds to let requests in flight finish and held KV be read before "
        "exiting anyway (a second SIGTERM exits at once)",
    )
    parser.add_argument(
        "--enable-log-requests",
        action="store_true",
        help="log each request's prompt token ids and parameters at INFO (logger pdserve.requests)",
    )
    parser.add_argument(
        "--uvicorn-log-level",
        default="warning",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="uvicorn's own logging, access log included from info (default: warning; vLLM's "
        "is info)",
    )
    parser.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let tool_choice "auto" (the default with tools) answer with calls, which '
        "--tool-call-parser reads from the model's text",
    )
    parser.add_argument(
        "--tool-call-parser",
        choices=TOOL_PARSERS.supported_names(),
        default=None,
        help="how the model writes tool calls: hermes (<tool_call>{...}</tool_call>), smollm2 "
        "(<tool_call>[{...}]</tool_call>, the default model's)",
    )
    parser.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja chat template, as a file or inline, in place of the tokenizer's "
        "(examples/tool_chat_template_smollm2.jinja gives the default model its tools)",
    )


def load_chat_template(template: str) -> str:
    """vLLM's --chat-template: a file's text, or the template itself."""
    path = Path(template)
    if path.suffix in (".jinja", ".j2") or path.is_file():
        if not path.is_file():
            raise SystemExit(f"--chat-template: no such file: {template}")
        return path.read_text()
    return template


def run_server(args: argparse.Namespace, engine_args: dict[str, Any]) -> int:
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise SystemExit("--enable-auto-tool-choice requires --tool-call-parser")
    chat_template = None if args.chat_template is None else load_chat_template(args.chat_template)
    if args.enable_log_requests:
        logging.getLogger("pdserve.requests").setLevel(logging.INFO)
    engine = AsyncLLM.from_engine_args(**engine_args)
    if chat_template is not None:
        # The one tokenizer every endpoint renders chats with (chat, tokenize, render).
        engine.tokenizer.chat_template = chat_template
    drain = Drain(engine, args.drain_timeout)
    app = build_app(
        engine,
        engine.config.model_config.name,
        args.api_key or envs.api_key(),
        args.max_pending_requests,
        drain,
        args.tool_call_parser if args.enable_auto_tool_choice else None,
    )
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.uvicorn_log_level,
        timeout_graceful_shutdown=5,
    )
    server = uvicorn.Server(config)
    drain.server = server
    try:
        server.run()
    finally:
        engine.shutdown()
    return 0
