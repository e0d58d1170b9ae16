"""The client's headers the proxy passes on to its instances: Authorization and X-Request-Id, as
vLLM's router does. Each is checked before either hop leaves (docs/proxy.md, "Headers"): httpx
refuses to send a value with surrounding whitespace, a control character or a non-ASCII one,
and a hop it refuses must not read as a failed instance. Such a value is the client's 400."""

from __future__ import annotations

from typing import Any

from starlette.datastructures import Headers

from pdserve.protocol.errors import OpenAIError

FORWARDED = ("Authorization", "X-Request-Id")
# Far above a UUID or a bearer token (JWTs run to a few KB), and well below what an instance's
# HTTP server takes in one request's headers.
MAX_CHARS = 4096
# What the proxy's OpenAPI schema declares, so that schemathesis fuzzes these headers too. The
# characters are said in words: a pattern beside the header format schemathesis gives every
# header value leaves it drawing values it then filters out, too many to test.
OPENAPI_PARAMETERS = [
    {
        "name": "X-Request-Id",
        "in": "header",
        "required": False,
        "description": "Names both hops of the request and its answer (default: a fresh id); "
        "printable ASCII and tabs.",
        "schema": {"type": "string", "maxLength": MAX_CHARS},
    }
]
# Optional: the instances ask for the key only when started with --api-key.
OPENAPI_SECURITY: list[dict[str, list[str]]] = [{}, {"APIKey": []}]
OPENAPI_SECURITY_SCHEMES: dict[str, Any] = {"APIKey": {"type": "http", "scheme": "bearer"}}


def forwarded_headers(headers: Headers) -> dict[str, str]:
    """The headers each hop carries, normalized: surrounding whitespace stripped, an empty value
    (or a bearer with no key) left out. Raises OpenAIError(400) naming a header that cannot be
    passed on: sent twice, over MAX_CHARS, or with a character other than printable ASCII or a
    tab."""
    forwarded = {}
    for name in FORWARDED:
        values = headers.getlist(name)
        if not values:
            continue
        if len(values) > 1:
            raise _refused(name, f"is sent {len(values)} times; send it once")
        if len(values[0]) > MAX_CHARS:
            raise _refused(name, f"is {len(values[0])} characters long; at most {MAX_CHARS}")
        value = values[0].strip(" \t")
        visible = value.replace("\t", " ")
        if not (visible.isascii() and visible.isprintable()):
            raise _refused(name, "may hold only printable ASCII characters and tabs")
        # An empty key variable in the client: no key, which an instance with --api-key refuses.
        if name == "Authorization" and value.lower() == "bearer":
            continue
        if value:
            forwarded[name] = value
    return forwarded


def _refused(name: str, why: str) -> OpenAIError:
    return OpenAIError(400, f"The {name} header {why}.", param=name)
