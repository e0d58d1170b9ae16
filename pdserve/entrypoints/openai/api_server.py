"""`pdserve serve`: the FastAPI app around one AsyncLLM, run by uvicorn.

The engine starts before the HTTP port opens, so a server that answers /health is ready.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import msgspec
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve import envs
from pdserve.engine.async_llm import AsyncLLM, RequestRejectedError
from pdserve.engine.core_client import EngineDeadError
from pdserve.entrypoints.openai.drain import Drain
from pdserve.entrypoints.openai.routes import (
    ServerState,
    error_response,
    request_id_of,
    router,
    server_state,
)
from pdserve.entrypoints.openai.serving import OpenAIServing, RequestFailedError
from pdserve.entrypoints.openai.serving_chat import OpenAIServingChat
from pdserve.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pdserve.kv_transfer_params import KVTransferParams
from pdserve.protocol.common import declare_model_limits
from pdserve.protocol.errors import (
    OpenAIError,
    validation_error,
    without_validation_422,
)
from pdserve.protocol.tool_calls import TOOL_PARSERS

logger = logging.getLogger(__name__)


# What a draining instance refuses: new work. Its /metrics, /health and /server_info still answer.
_REFUSED_WHILE_DRAINING = {"/v1/completions", "/v1/chat/completions"}


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

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        if drain is not None:
            drain.install()
        yield

    app = FastAPI(lifespan=lifespan)
    app.state.server = ServerState(
        engine,
        serving,
        OpenAIServingCompletion(serving),
        OpenAIServingChat(serving, tool_parser),
        api_key,
        drain,
    )
    app.middleware("http")(_admit)
    for error, handler in _ERROR_HANDLERS.items():
        app.add_exception_handler(error, handler)
    app.include_router(router)
    openapi = app.openapi
    mc = engine.config.model_config
    limits = {
        "vocab": mc.vocab_size - 1,
        "max_logprobs": None if mc.max_logprobs < 0 else mc.max_logprobs,
        "max_num_seqs": engine.config.scheduler_config.max_num_seqs,
    }
    app.openapi = lambda: declare_model_limits(without_validation_422(openapi()), limits)  # type: ignore[method-assign]
    return app


async def _admit(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
    """New work is refused while draining; every route but /health needs the API key."""
    server = server_state(request)
    if server.drain is not None and server.drain.draining:
        if request.url.path in _REFUSED_WHILE_DRAINING:
            return error_response(
                OpenAIError(
                    503,
                    "This instance is draining (shutting down); send the request elsewhere.",
                    "ServiceUnavailableError",
                )
            )
    if (
        server.api_key
        and request.url.path != "/health"
        and request.headers.get("Authorization") != f"Bearer {server.api_key}"
    ):
        return error_response(OpenAIError(401, "Invalid or missing API key."))
    return await call_next(request)


async def _on_validation_error(request: Request, e: Exception) -> JSONResponse:
    assert isinstance(e, RequestValidationError)
    # A body refused before it is read may still name a prefill instance's KV: free it now
    # rather than at the end of its lease (pd_lessons 2).
    body = e.body if isinstance(e.body, dict) else {}
    try:
        params = KVTransferParams.from_json(body.get("kv_transfer_params"))
    except (ValueError, TypeError, msgspec.ValidationError):
        params = None
    if params is not None:
        await server_state(request).engine.handoff.release_if_rejected(
            params, request_id_of(request)
        )
    return error_response(validation_error(list(e.errors())))


async def _on_http_error(request: Request, e: Exception) -> JSONResponse:
    assert isinstance(e, StarletteHTTPException)
    # Starlette's own answers (404 no route, 405 with its Allow header) keep their headers.
    response = error_response(OpenAIError(e.status_code, str(e.detail)))
    response.headers.update(e.headers or {})
    return response


def _answering(status: int, prefix: str = "") -> Callable[[Request, Exception], Awaitable[Any]]:
    async def handler(request: Request, e: Exception) -> JSONResponse:
        return error_response(OpenAIError(status, f"{prefix}{e}"))

    return handler


async def _on_openai_error(request: Request, e: Exception) -> JSONResponse:
    assert isinstance(e, OpenAIError)
    return error_response(e)


_ERROR_HANDLERS: dict[type[Exception], Callable[[Request, Exception], Awaitable[Any]]] = {
    OpenAIError: _on_openai_error,
    RequestValidationError: _on_validation_error,
    StarletteHTTPException: _on_http_error,
    EngineDeadError: _answering(503, "The engine is not available: "),
    RequestFailedError: _answering(500),
    RequestRejectedError: _answering(400),
}


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
