"""OpenAI's error body: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    """OpenAI's error body, as the OpenAPI schema declares it."""

    error: ErrorDetail


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """A route's error answers for its OpenAPI schema (`responses=`)."""
    return {status: {"model": ErrorResponse, "description": _TYPES[status]} for status in statuses}


# A completion's 200: JSON, or with "stream": true server-sent events.
GENERATION_200 = {
    200: {
        "description": "The answer, or its stream of server-sent events",
        "content": {"application/json": {}, "text/event-stream": {}},
    }
}


def without_validation_422(schema: dict[str, Any]) -> dict[str, Any]:
    """FastAPI declares 422 for a bad body; pdserve answers 400 (OpenAI's, declared per route)."""
    for operations in schema.get("paths", {}).values():
        for operation in operations.values():
            operation.get("responses", {}).pop("422", None)
    for name in ("HTTPValidationError", "ValidationError"):
        schema.get("components", {}).get("schemas", {}).pop(name, None)
    return schema


def validation_error(errors: list[Any]) -> OpenAIError:
    """The 400 of a body that does not validate: its first error, naming the field."""
    first = errors[0]
    if first.get("type") == "json_invalid":
        return OpenAIError(400, f"Malformed JSON body: {first.get('msg')}")
    # A union body's errors name its member first (TokenizePromptRequest, or the validator
    # that wraps it, "function-wrap[...]"): not a field.
    loc = [
        str(x)
        for x in first.get("loc", ())
        if x != "body" and not str(x)[:1].isupper() and not str(x).startswith("function-")
    ]
    param = ".".join(loc) or None
    message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
    return OpenAIError(400, message, param=param)


class OpenAIError(Exception):
    def __init__(
        self, status: int, message: str, type: str | None = None, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _TYPES.get(status, "InternalServerError")
        self.param = param

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.status,
            }
        }
