"""The proxy's OpenAPI schema: its own routes and errors, with the request bodies its decode
instances declare (the proxy forwards them; the instances check them, against the served
model's limits), so that a schema-valid request is one the deployment takes; and the headers it
forwards with them, as it checks them (proxy/headers.py)."""

from __future__ import annotations

import copy
from typing import Any

import httpx
from fastapi import FastAPI

from pdserve.proxy.headers import (
    OPENAPI_PARAMETERS,
    OPENAPI_SECURITY,
    OPENAPI_SECURITY_SCHEMES,
)
from pdserve.proxy.instances import InstancePool

_FORWARDED = ("/v1/completions", "/v1/chat/completions")


class ProxySchema:
    def __init__(self, app: FastAPI, decode: InstancePool) -> None:
        self.app = app
        self.decode = decode
        self.merged: dict[str, Any] | None = None

    async def get(self) -> dict[str, Any]:
        """The merged schema once an instance gave its own (cached); the proxy's until then."""
        if self.merged is not None:
            return self.merged
        own = with_headers(self.app.openapi())
        for instance in self.decode.instances:
            try:
                resp = await instance.client.get("/openapi.json")
                resp.raise_for_status()
                self.merged = merge(own, resp.json())
                return self.merged
            except (httpx.HTTPError, ValueError):
                continue
        return own


def with_headers(own: dict[str, Any]) -> dict[str, Any]:
    schema = copy.deepcopy(own)
    for path in _FORWARDED:
        operation = schema["paths"][path]["post"]
        operation.setdefault("parameters", []).extend(OPENAPI_PARAMETERS)
        operation["security"] = OPENAPI_SECURITY
    schemes = schema.setdefault("components", {}).setdefault("securitySchemes", {})
    schemes.update(OPENAPI_SECURITY_SCHEMES)
    return schema


def merge(own: dict[str, Any], instance: dict[str, Any]) -> dict[str, Any]:
    schema = copy.deepcopy(own)
    for path in _FORWARDED:
        body = instance["paths"][path]["post"]["requestBody"]
        schema["paths"][path]["post"]["requestBody"] = body
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for name, definition in instance.get("components", {}).get("schemas", {}).items():
        components.setdefault(name, definition)
    return schema
